"""The main screen (``MainScreen``), its collaborators and the Messages they post."""

from kvchat.tui.main.screen import MainScreen

__all__ = ["MainScreen"]
