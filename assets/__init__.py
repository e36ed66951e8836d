"""Files the app reads at run time (the Textual stylesheet); installed as ``kvchat.assets``."""
