"""The model catalog (``catalog.toml``); installed as ``kvchat.models``."""
