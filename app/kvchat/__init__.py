"""kvchat: a terminal chat app that keeps each conversation's KV cache."""

__version__ = "0.1.0"
