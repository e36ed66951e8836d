"""The Textual terminal app. It only presents: every model call goes through ChatService."""
