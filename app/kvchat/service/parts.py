"""What :class:`kvchat.service.chat.ChatService` gives the parts mixed into it, declared once."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from kvchat.config import Settings
    from kvchat.engine import CancelCheck, Engine, GenerationParams
    from kvchat.kvcache import RestoreResult
    from kvchat.kvcache.tiers import KVTiers
    from kvchat.service.reports import TokenCallback, TurnReport
    from kvchat.store import Session, Store
    from kvchat.store.locks import SessionLocks


class ServiceParts:
    """The base of the service's mixins: the members ChatService provides (for type checkers;
    nothing here at run time)."""

    if TYPE_CHECKING:
        settings: Settings
        store: Store
        tiers: KVTiers
        locks: SessionLocks

        @property
        def engine(self) -> Engine: ...

        def load_engine(self) -> Engine: ...

        def make_hot(
            self, session_id: str, *, no_restore: bool = False, prompt: list[int] | None = None
        ) -> RestoreResult: ...

        def _turn_lock(self, session_id: str) -> AbstractContextManager[None]: ...

        def _remember(self, session_id: str) -> None: ...

        def _record_model(self, session_id: str) -> None: ...

        def _system_head(self, session: Session) -> list[dict[str, str]]: ...

        def _after_reply(
            self, report: TurnReport, session: Session, prompt: list[int], dropped: int = 0
        ) -> None: ...

        def _abandon_upkeep(self) -> None: ...

        def _turn(
            self,
            session_id: str,
            params: GenerationParams,
            on_token: TokenCallback | None,
            cancel: CancelCheck | None,
            no_restore: bool,
            replaces: int | None = None,
        ) -> TurnReport: ...
