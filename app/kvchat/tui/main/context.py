"""What every collaborator of the main screen is given, in one object, and how each kind of
background work runs.

The screen builds one ``ScreenContext`` when it composes its widgets and hands it to each
collaborator (``opener``, ``turns``, ``idle_work``…) in place of the same seven to nine
constructor parameters. The ``Job`` constants below are the one table of how work runs:
every background job is a worker of the screen, started through ``ScreenContext.run``, so
one handler of the screen reports the failures of all of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

if TYPE_CHECKING:
    from textual.app import App
    from textual.message import Message
    from textual.worker import Worker

    from kvchat.tui.backend import Backend
    from kvchat.tui.main.screen_state import ScreenState
    from kvchat.tui.main.slash import SlashCommands
    from kvchat.tui.widgets.conversation import Conversation
    from kvchat.tui.widgets.documents import DocumentsPanel
    from kvchat.tui.widgets.prompt import PromptInput
    from kvchat.tui.widgets.sidebar import SessionList
    from kvchat.tui.widgets.status import StatusBar

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class Job:
    """One kind of background work: its worker's name (failure notices say it), its group,
    and whether starting one cancels the one of its group still running."""

    name: str
    group: str
    exclusive: bool = False


# Every kind, with its group and exclusivity; the key table's actions run in the "action"
# group (the screen's ``action_*`` workers, which Textual's bindings call).
STARTUP = Job("startup", "startup")
OPEN_SESSION = Job("open_session", "open", exclusive=True)
REFRESH_SESSIONS = Job("request_refresh", "sidebar", exclusive=True)
MORE_SESSIONS = Job("load_more_sessions", "sidebar-pages", exclusive=True)
TURN = Job("run_turn", "turn")
HOUSEKEEPING = Job("_housekeep", "housekeeping")
WATCH = Job("check_for_changes", "watch", exclusive=True)
SESSION_MODEL = Job("note_session_model", "model-note", exclusive=True)
COPY = Job("_copy_elsewhere", "copy")
LATEST = Job("show_latest", "latest", exclusive=True)
SWITCH_VERSION = Job("switch_version", "action")
PICK_MODEL = Job("pick_model", "models", exclusive=True)
ATTACH_OFFER = Job("offer_attachments", "attach", exclusive=True)
DOCUMENTS = Job("show_documents", "documents", exclusive=True)
SAVE_DRAFTS = Job("save_drafts", "drafts")
SAVE_DEFAULT_MODEL = Job("save_default_model", "default-model")
RESTORE_DRAFT = Job("restore_draft", "draft-restore", exclusive=True)
COUNT_TOKENS = Job("count_tokens", "count-tokens", exclusive=True)


class RunJob(Protocol):
    """Starts ``work(*args, **kwargs)`` as a worker of the screen, as ``job`` says."""

    def __call__(
        self,
        job: Job,
        work: Callable[P, Coroutine[Any, Any, T]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Worker[T]: ...


@dataclass(frozen=True)
class ScreenContext:
    """The app, its backend (the service and its threads), the screen's shared state and
    widgets, and the three things the screen does for its collaborators."""

    app: App[Any]
    backend: Backend
    state: ScreenState
    conversation: Conversation
    sessions: SessionList
    status: StatusBar
    prompt: PromptInput
    documents: DocumentsPanel  # the attachments and the open session's documents
    slash: SlashCommands  # the commands typed in the input (/help, …), by their owners
    post: Callable[[Message], bool]  # a Message to the screen
    refresh: Callable[[], Awaitable[None]]  # reads the sessions list again and shows it
    run: RunJob  # background work, as a worker of the screen
