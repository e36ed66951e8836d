"""Modal dialogs and the error screen."""
