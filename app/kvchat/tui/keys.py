"""Every key of the app in one table: bindings, the help screen, the command palette
and KEYS.md are all made from it, so they cannot disagree."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class Key:
    keys: str  # Textual key names, comma-separated; "" for keys handled by a widget
    label: str  # how the help screen and KEYS.md show the key
    action: str | None  # app action name; None for keys a widget handles itself
    description: str
    footer: str | None = None  # short footer label; None keeps it out of the footer
    palette: bool = True  # listed in the command palette


KEYS: tuple[Key, ...] = (
    Key("", "Enter", None, "Send the message", palette=False),
    Key(
        "",
        "Ctrl+J",
        None,
        "Insert a new line in the message (also Shift+Enter, where the terminal reports it)",
        palette=False,
    ),
    Key(
        "escape",
        "Esc",
        "cancel",
        "Stop the reply being generated (the partial reply is kept)",
        footer="Stop",
    ),
    Key("ctrl+n", "Ctrl+N", "new_session", "New session", footer="New"),
    Key("f2", "F2", "rename", "Rename the session"),
    Key(
        "f8",
        "F8",
        "delete",
        "Delete the session (asks first): the one highlighted when the sessions list has focus",
    ),
    Key("ctrl+f", "Ctrl+F", "search", "Search all messages and jump to a hit", footer="Search"),
    Key(
        "ctrl+s", "Ctrl+S", "export", "Export the session (Markdown, JSON or HTML)", footer="Export"
    ),
    Key("ctrl+g", "Ctrl+G", "settings", "Session settings: system prompt, sampling and tags"),
    Key("ctrl+r", "Ctrl+R", "regenerate", "Regenerate the last reply"),
    # Not F6/F7 (the input takes them), F10 (GNOME Terminal's menu), F11 (full screen).
    Key(
        "f12",
        "F12",
        "continue_reply",
        "Continue the last reply (one stopped at the token limit) from where it stopped",
    ),
    Key("ctrl+t", "Ctrl+T", "branch", "Branch a new session at the selected message (or the last)"),
    Key("f4", "F4", "edit_message", "Edit your selected (or last) message: new branch, new reply"),
    Key("ctrl+o", "Ctrl+O", "copy_message", "Copy the selected message (or the last reply)"),
    # Not Ctrl+B: it is tmux's prefix key. F5 is bound neither by tmux nor by Textual's inputs.
    Key(
        "f5",
        "F5",
        "copy_code",
        "Copy a code block (of the selected message, or any of the session)",
    ),
    Key(
        "f3",
        "F3",
        "message_details",
        "Time and figures of the selected message (or the last reply)",
    ),
    # Not F7 (nor F6): the message input, a TextArea, takes them (select all / select line).
    Key(
        "f9",
        "F9",
        "pick_model",
        "Pick a model (catalog and local files, with what fits this machine)",
    ),
    # Ctrl+\\: every Ctrl+letter is taken (by the input, the terminal or tmux); no terminal,
    # tmux or input binds this one (in raw mode it is not SIGQUIT).
    Key(
        "ctrl+backslash",
        "Ctrl+\\",
        "attach",
        "Attach files (or a folder, with a glob) to the next message; shows what they take first",
    ),
    # Ctrl+/ (most terminals send it as Ctrl+_): no terminal, tmux or input binds it.
    Key(
        "ctrl+underscore,ctrl+slash",
        "Ctrl+/",
        "toggle_thinking",
        "Thinking on / off for this session (a thinking model whose template has the switch)",
    ),
    Key(
        "ctrl+l",
        "Ctrl+L",
        "focus_sessions",
        "Go to the sessions list (Enter opens a session); in the list, hide it (it hides "
        "itself below 80 columns)",
    ),
    # Shift+F keys: every Ctrl+letter is taken, and the input takes F6/F7 (see above).
    Key(
        "f14,shift+f2",
        "Shift+F2",
        "filter_sessions",
        "Find a session: filter the list by title or #tag as you type (/ in the list too; "
        "Esc clears)",
        footer="Find",
    ),
    Key(
        "f15,shift+f3",
        "Shift+F3",
        "pin_session",
        "Pin / unpin the session (pinned ones come first in the list): the one highlighted "
        "when the sessions list has focus",
    ),
    Key(
        "f17,shift+f5",
        "Shift+F5",
        "copy_conversation",
        "Copy the whole conversation (as Markdown)",
    ),
    Key(
        "",
        "Space (on a session)",
        None,
        "Fold / unfold the branches (forks and edits) under a session in the list",
        palette=False,
    ),
    Key(
        "",
        "Tab / Shift+Tab",
        None,
        "Move between the input, the sessions and the messages",
        palette=False,
    ),
    Key(
        "",
        "↑ / ↓ (on a message)",
        None,
        "Previous / next message (↓ past the last one: the input)",
        palette=False,
    ),
    Key(
        "",
        "← / → (on the last reply)",
        None,
        "Previous / next version of the reply (Ctrl+R makes a new one; the header shows 2/3)",
        palette=False,
    ),
    Key(
        "",
        "Typing (on a message or the sessions list)",
        None,
        "Every printable key goes to the input, as typed (on the list: but Space and /); no "
        "letter acts on a message: Ctrl+O, F5, F3, Ctrl+T and F4 act on the selected one",
        palette=False,
    ),
    Key(
        "",
        "Enter (on a message)",
        None,
        "Show all of a long message (folded after 20 lines), or fold it again; on a thinking "
        "model's reply, show / fold its reasoning (a click on its line too)",
        palette=False,
    ),
    Key("f1", "F1", "help", "Show every key", footer="Help"),
    Key("ctrl+p", "Ctrl+P", None, "Command palette: every action by name", palette=False),
    Key(
        "ctrl+q",
        "Ctrl+Q",
        "app.quit",
        "Quit (saves the open session's memory first)",
        footer="Quit",
    ),
)


def bindings() -> list[Binding]:
    """The app's bindings; Ctrl+Q is a priority binding so no widget can swallow it."""
    out: list[Binding] = []
    for key in KEYS:
        if not key.keys or not key.action:
            continue
        out.append(
            Binding(
                key.keys,
                key.action,
                key.footer or key.description,
                show=key.footer is not None,
                priority=key.action == "app.quit",
                id=key.action,
                tooltip=key.description,
                # Terminals send Shift+F2 as F14: the footer shows the key pressed.
                key_display=key.label.replace("Shift+", "⇧") if "shift+" in key.keys else None,
            )
        )
    return out


def keys_markdown() -> str:
    """The key reference as a Markdown table (KEYS.md and the README)."""
    rows = ["| Key | Action |", "| --- | --- |"]
    rows += [f"| {k.label} | {k.description} |" for k in KEYS]
    return "\n".join(rows) + "\n"
