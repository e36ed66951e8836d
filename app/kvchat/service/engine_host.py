"""The model the service runs: loaded lazily on the plan for this machine, attached to the
tiers that keep its KV, closed (or set aside, when it was lent) when another model loads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvchat.config import Settings
from kvchat.crashes import unreported_crash
from kvchat.engine import Engine, RemoteChatEngine, TokenEngine, create_engine, engine_config
from kvchat.engine.probe import ProbeOutcome, probed_config
from kvchat.errors import KvchatError
from kvchat.kvcache import Fingerprint
from kvchat.kvcache.remote_tiers import RemoteTiers
from kvchat.kvcache.server_tiers import ServerSlots
from kvchat.kvcache.tiers import KVTiers, Tiers
from kvchat.planner.defaults import DefaultsChoice, plan_defaults, retry_plan
from kvchat.planner.model_lookup import model_path
from kvchat.service.checks import check_engine_config, same_file
from kvchat.service.reasoning import (
    NO_SWITCH,
    SWITCHES,
    ReasoningStyle,
    ThinkingSwitch,
    detect_style,
    find_switch,
)
from kvchat.store import Store

# An OpenAI-compatible server's replies as the service hands them on: its reasoning
# (reasoning_content) inside think tags before the answer (see TurnPipeline.run_remote).
REMOTE_REASONING = ReasoningStyle("think")


class EngineHost:
    """One engine at a time, and the tiers its KV lives in.

    ``settings`` is the service's (a model switch replaces it). ``lent``: an engine loaded
    by someone else (a test suite loads a model once for many services); it is used while
    the settings name its model file, and never closed here.
    """

    def __init__(
        self,
        settings: Settings,
        directory: Path,
        store: Store,
        tiers: KVTiers,
        lent: Engine | None = None,
    ) -> None:
        self.settings = settings
        self.directory = directory
        self.store = store
        self.local_tiers = tiers
        # The tiers in use: the local ones, or a llama-server's slots once its engine is open.
        self.tiers: Tiers = tiers
        self._slots: ServerSlots | None = None
        # The engine when it takes whole messages (capabilities.remote_chat), else None.
        self.remote: RemoteChatEngine | None = None
        self._engine: Engine | None = None
        self._lent = lent
        self._set_aside: Engine | None = None
        self._fingerprint: Fingerprint | None = None
        # n_ctx, KV types, flash attention and GPU layers as planned (see load).
        self.plan: DefaultsChoice | None = None
        # What the engine probe chose for this machine (None: nothing probed, see load).
        self.probe: ProbeOutcome | None = None
        self._style: ReasoningStyle | None = None
        self._switch: ThinkingSwitch | None = None

    # --- loading ---------------------------------------------------------------------------

    def load(self) -> Engine:
        """Load the model (idempotent); raises KvchatError for a missing or invalid file."""
        if self._engine is not None:
            return self._engine
        if self.settings.engine == "openai":  # the server has the model: nothing to plan
            opened = create_engine(self.settings, Path(self.settings.openai_model or "remote"))
            remote = opened.remote_chat()
            if remote is None or not opened.capabilities.remote_chat:
                raise KvchatError("engine openai did not open an OpenAI-compatible server")
            self._engine, self.remote = opened, remote
            self.tiers = RemoteTiers(remote.url)
            return opened
        path = model_path(self.settings)
        self.plan = plan_defaults(self.settings, path)
        planned = self.plan.apply(self.settings)
        if self._lent is not None:
            engine = self._lent
            check_engine_config(
                engine, engine_config(planned, path), self.settings.model_fields_set
            )
            lent = engine.token_level()
            if lent is not None:
                lent.clear()  # another service's KV is not this one's
        else:
            engine = self._open(planned, path)
        self._engine = engine
        slots = engine.server_slots()
        if slots is not None:  # a llama-server keeps the KV in its slots
            self._slots = ServerSlots(self.store, slots)
            self.tiers = self._slots
            return engine
        self._fingerprint = Fingerprint.current(path, engine.layout())
        self.tiers.attach(engine, self._fingerprint)
        return engine

    def _open(self, planned: Settings, path: Path) -> Engine:
        """Open the engine on the settings the probe found safe and fast on this machine;
        a GPU that fails to load it gets smaller plans (fewer layers, less context)."""
        config = engine_config(planned, path)
        if planned.engine == "llama.cpp":
            config, self.probe = probed_config(
                config,
                repack=planned.repack,
                threads=planned.n_threads is None,
                directory=self.directory,
                timeout=planned.probe_timeout_s,
                in_use=True,
            )
        tried: list[str] = []
        while True:
            try:
                return create_engine(planned, path, config=config)
            except KvchatError as exc:
                assert self.plan is not None
                smaller = retry_plan(self.plan, config, str(exc))
                if smaller is None:
                    if tried:
                        raise KvchatError(f"{exc} (after: {'; '.join(tried)})") from exc
                    raise
                tried.append(smaller.retry_note)
                self.plan = smaller
                config = replace(config, n_ctx=smaller.n_ctx, n_gpu_layers=smaller.n_gpu_layers)

    @property
    def takes_messages(self) -> bool:
        """Whether the engine takes whole messages, not token ids (``remote_chat``), known
        before it opens (engine openai): its turns store the user's message first."""
        if self._engine is not None:
            return self._engine.capabilities.remote_chat
        return self.settings.engine == "openai"  # (before it opens)

    def token_engine(self) -> TokenEngine:
        """The engine in its token-level role (loaded on first use); a KvchatError for one
        that takes whole messages (the service asks ``takes_messages`` first)."""
        tokens = self.load().token_level()
        if tokens is None:
            raise KvchatError("this engine takes whole messages, not token ids")
        return tokens

    @property
    def engine(self) -> Engine:
        """The engine, loaded on first use."""
        return self.load()

    @property
    def loaded(self) -> Engine | None:
        """The engine if it is loaded (None: not yet, or released)."""
        return self._engine

    @property
    def loaded_model_path(self) -> Path | None:
        """The model file the engine has open (None before it loads)."""
        return self._engine.config.model_path if self._engine is not None else None

    @property
    def fingerprint(self) -> Fingerprint:
        self.load()
        assert self._fingerprint is not None
        return self._fingerprint

    @property
    def reasoning_style(self) -> ReasoningStyle:
        """How the loaded model's replies carry reasoning (its chat template, rendered)."""
        if self._style is None:
            if self.takes_messages:  # known without asking the server
                self._style = REMOTE_REASONING
            else:
                self._style = detect_style(self.token_engine().render)
        return self._style

    @property
    def thinking_switch(self) -> ThinkingSwitch:
        """The chat-template keyword that turns the model's thinking on or off (found by
        rendering; none for a template without one, or a llama-server's own template)."""
        if self._switch is None:
            if self.takes_messages:  # sent with each request as chat_template_kwargs
                keyword, on, off = SWITCHES[0]
                self._switch = ThinkingSwitch(keyword, on, off)
                return self._switch
            engine = self.load()
            if engine.capabilities.server_slots:
                self._switch = NO_SWITCH
            else:
                tokens = self.token_engine()
                self._switch = find_switch(lambda options: self._render_with(tokens, options))
        return self._switch

    @staticmethod
    def _render_with(engine: TokenEngine, options: dict[str, object]) -> str:
        kept = engine.template_options
        engine.template_options = options
        try:
            return engine.render([{"role": "user", "content": "Q"}])
        finally:
            engine.template_options = kept

    def use_template_options(self, think: bool | None) -> None:
        """Render the next prompts with the session's thinking choice (None: the
        template's default)."""
        if self.load().capabilities.remote_chat:
            return  # the server renders: the choice goes with each request
        self.token_engine().template_options = self.thinking_switch.options(think)

    def kv(self) -> Tiers:
        """The tiers; a llama-server's slot files are known once its engine is open."""
        if self.settings.engine == "llama-server":
            self.load()
        if self.settings.engine == "openai" and self._engine is None:
            return RemoteTiers(self.settings.openai_url or "")  # nothing to ask the server
        return self.tiers

    # --- releasing -------------------------------------------------------------------------

    def release(self) -> None:
        """Save the hot session if it has unsaved KV, then close the engine (a lent one is
        left open for its owner). The caller drops pending housekeeping first."""
        if self._engine is not None:
            self.tiers.detach()
            if self._engine is not self._lent:
                self._engine.close()
            self._engine = None
            if self.remote is not None:  # kept for plan_note, like a local engine's plan
                self.tiers = self.local_tiers
            self._style = None
            self._switch = None

    def lend_for(self, path: Path | None) -> None:
        """A lent engine serves its own model file only: set it aside while another model
        is loaded, use it again when its model comes back."""
        lent = self._lent or self._set_aside
        if lent is None:
            return
        self._set_aside = lent
        self._lent = lent if path is not None and same_file(lent.config.model_path, path) else None

    # --- what to tell the user ---------------------------------------------------------------

    def startup_notices(self) -> list[str]:
        """Lines to say once when the model has loaded: the probe's choice the first time
        it was made, and a crash of the last run not reported yet."""
        notices = []
        if self.probe is not None and self.probe.fresh and self.probe.reason:
            notices.append(self.probe.reason)
        crash = unreported_crash(self.directory)
        if crash is not None:
            notices.append(crash.line())
        return notices

    @property
    def plan_note(self) -> str | None:
        """The context settings chosen for this machine, one line (None before the model
        loads)."""
        if self.remote is not None:
            return self.remote.note
        if self._slots is not None:  # the model runs in a llama-server
            return self._slots.note
        if self.plan is None:
            return None
        notes = [self.plan.note]
        engine = self._engine
        best = self.probe.best_threads("generate") if self.probe is not None else None
        if engine is not None and best and engine.config.n_threads != best:
            config = engine.config
            notes.append(
                f"threads re-measured after a slow reply: now {config.n_threads} for "
                f"generation, {config.n_threads_batch} for prompts"
            )
        return " — ".join(notes)
