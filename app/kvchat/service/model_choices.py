"""Choosing the model while the app runs, and the model each session last ran with.

:class:`ModelChoices` is the service's model picker. The choices are the
catalog's models (present or not), the GGUF files in the models dir, the bundled model and
the model loaded now, each with the planner's fit for this machine in one line. Nothing
here downloads (that stays ``kvchat models pull``) and a model file is only ever read.
Switching saves the hot session's KV (as closing does), loads the new file, and on failure
loads the previous one again, so the service stays usable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.engine.probe import measured_speed
from kvchat.errors import KvchatError
from kvchat.paths import bundled_model_path, models_dir
from kvchat.planner.catalog import (
    CatalogEntry,
    info_from_catalog,
    load_catalog,
    with_catalog_marks,
)
from kvchat.planner.cpu import cpu_fit
from kvchat.planner.defaults import (
    DefaultsChoice,
    GpuBudget,
    find_budget,
    gpu_offload_supported,
    plan_defaults,
)
from kvchat.planner.gguf_info import read_gguf
from kvchat.planner.kv_bytes import fmt_bytes
from kvchat.planner.model_info import model_marks
from kvchat.planner.model_lookup import model_path
from kvchat.planner.model_names import model_name
from kvchat.planner.stores import discover
from kvchat.service.checks import same_file
from kvchat.service.engine_host import EngineHost
from kvchat.service.upkeep import Upkeep
from kvchat.store import Store
from kvchat.store.store import StoreFull
from kvchat.text import one_line

if TYPE_CHECKING:
    from kvchat.config import Settings
    from kvchat.planner.model_info import ModelInfo

# The engine that runs its model in this process; another (llama-server) has its own model.
LOCAL_ENGINE = "llama.cpp"


@dataclass(frozen=True)
class ModelChoice:
    """One model the user can pick: where it is (None: not downloaded) and how it fits."""

    name: str  # what switch_model and --model take: a catalog name, a file name or a path
    title: str
    # "catalog", "local" (the models dir), "bundled", "file" (elsewhere) or the store it is
    # in ("Ollama", "LM Studio", ...: kvchat.planner.stores)
    source: str
    path: Path | None
    size_bytes: int | None
    fit: str  # the planner's fit for this machine, one line
    loaded: bool = False
    marks: tuple[str, ...] = ()  # "thinking", "hybrid" (kvchat.planner.model_info)

    @property
    def present(self) -> bool:
        return self.path is not None

    @property
    def size(self) -> str:
        return fmt_bytes(self.size_bytes) if self.size_bytes else "size ?"

    @property
    def pull_hint(self) -> str | None:
        """What to run to get it, when it is a catalog model that is not here (a model in
        another app's store that cannot be used says why in ``fit``)."""
        if self.present or self.source != "catalog":
            return None
        return f"not downloaded: kvchat models pull {self.name}"


@dataclass(frozen=True)
class SessionModel:
    """The model a session last ran with."""

    path: Path
    name: str
    present: bool  # the file is still there
    loaded: bool  # it is the model loaded now


def model_label(path: Path, model_dirs: Sequence[str] = ()) -> str:
    """How a model file is named to the user: its store name when it is in another app's
    store (``ollama:gemma3:270m``), else its file name without ``.gguf``."""
    return model_name(path, model_dirs)


def fit_line(choice: DefaultsChoice, info: ModelInfo | None = None) -> str:
    """The plan in a few words: "fits: 32k context, all layers on the GPU", "CPU only: …"."""
    ctx = f"{choice.n_ctx // 1024}k" if choice.n_ctx % 1024 == 0 else f"{choice.n_ctx:,}"
    kv = "" if choice.type_k == choice.type_v == "f16" else f", KV {choice.type_k}"
    if choice.device == "gpu":
        return f"fits: {ctx} context{kv}, all layers on the GPU"
    if choice.device == "partial":
        total = f" of {info.n_layer + 1}" if info is not None else ""
        return f"partly fits: {ctx} context{kv}, {choice.n_gpu_layers}{total} layers on the GPU"
    return f"CPU only: {ctx} context{kv}"


class ModelChoices:
    """The model picker's service side (see the module docstring): switching goes through
    the engine host, after the last turn's housekeeping is dropped."""

    def __init__(self, host: EngineHost, store: Store, upkeep: Upkeep) -> None:
        self.host = host
        self.store = store
        self.upkeep = upkeep

    @property
    def settings(self) -> Settings:
        return self.host.settings

    # --- the choices ------------------------------------------------------------------------

    def model_choices(self, also: Path | None = None) -> list[ModelChoice]:
        """Catalog models, GGUF files in the models dir, models in other apps' stores (an
        unusable one with its reason), the bundled model, the loaded model (when it is none
        of those) and ``also`` (a session's remembered file), each once."""
        try:
            catalog = load_catalog()
        except KvchatError:
            catalog = []
        planner = PlannerFit(self.settings, self.host.directory)
        loaded = self.loaded_model_path
        choices: list[ModelChoice] = []
        seen: list[Path] = []

        def add(
            name: str,
            title: str,
            source: str,
            path: Path | None,
            info: ModelInfo | None,
            size: int | None,
            problem: str | None = None,
        ) -> None:
            if path is not None:
                if any(same_file(path, p) for p in seen):
                    return
                seen.append(path)
            choices.append(
                ModelChoice(
                    name=name,
                    title=title,
                    source=source,
                    path=path,
                    size_bytes=size,
                    fit=problem or planner.fit(info),
                    loaded=path is not None and loaded is not None and same_file(path, loaded),
                    marks=model_marks(info) if info is not None else (),
                )
            )

        for entry in catalog:
            path = _catalog_file(entry)
            info, problem = _read(path) if path else (_estimate(entry), None)
            info = with_catalog_marks(info, entry) if info is not None else None
            size = path.stat().st_size if path else entry.size_bytes
            source = "bundled" if entry.bundled else "catalog"
            add(entry.name, entry.title, source, path, info, size, problem)
        folder = models_dir()
        for path in sorted(folder.glob("*.gguf")) if folder.is_dir() else []:
            if path.is_file():
                info, problem = _read(path)
                add(path.name, model_label(path), "local", path, info, _size(path), problem)
        for found in discover(self.settings.model_dirs):
            if found.path is None or found.problem:
                add(
                    found.name,
                    found.name,
                    found.store,
                    None,
                    None,
                    found.size_bytes or None,
                    found.problem,
                )
                continue
            info, problem = _read(found.path)
            add(found.name, found.name, found.store, found.path, info, found.size_bytes, problem)
        bundled = bundled_model_path()
        if bundled is not None:
            info, problem = _read(bundled)
            add(
                "bundled",
                "bundled default model",
                "bundled",
                bundled,
                info,
                _size(bundled),
                problem,
            )
        for extra in (loaded, also):
            if extra is not None and extra.is_file():
                info, problem = _read(extra)
                add(str(extra), model_label(extra), "file", extra, info, _size(extra), problem)
        # What is here first (in the order above), then what `kvchat models pull` can get.
        return sorted(choices, key=lambda c: not c.present)

    @property
    def loaded_model_path(self) -> Path | None:
        """The model file the engine has open (None before it loads)."""
        return self.host.loaded_model_path

    @property
    def loaded_name(self) -> str:
        """How the loaded model is named to the user (see :func:`model_label`; "" before it
        loads)."""
        path = self.loaded_model_path
        return self.name_of(path) if path is not None else ""

    def name_of(self, path: Path) -> str:
        """How the model file ``path`` is named to the user."""
        return model_label(path, self.settings.model_dirs)

    # --- switching --------------------------------------------------------------------------

    def switch_model(self, spec: str | Path) -> Path:
        """Load another model (a path, a file in the models dir, a catalog name, "bundled")
        in place of the loaded one; returns its file.

        The hot session's KV is saved first, as on close. A file that is missing or not
        GGUF is refused before anything is unloaded; one that llama.cpp cannot load is
        reported after the previous model has been loaded again.
        """
        if self.settings.engine != LOCAL_ENGINE:
            raise KvchatError(
                f"the model is the {self.settings.engine}'s own: start it with another "
                "model to switch"
            )
        wanted = self.settings.model_copy(update={"model": str(spec)})
        path = model_path(wanted)  # KvchatError: missing, not GGUF, not downloaded
        loaded = self.loaded_model_path
        if loaded is not None and same_file(loaded, path):
            return loaded
        host = self.host
        previous = self.settings
        self._release()
        host.tiers.mark_hot(None)  # the next context holds no session's KV
        host.lend_for(path)
        host.settings = wanted
        try:
            host.load()
        except (KvchatError, ValueError) as exc:
            self._release()
            host.settings = previous
            why = one_line(str(exc))
            try:
                back = loaded or model_path(previous)
                host.lend_for(back)
                host.load()
            except (KvchatError, ValueError) as again:
                raise KvchatError(
                    f"cannot load {path.name}: {why}; the previous model did not load "
                    f"again either: {one_line(str(again))}"
                ) from None
            raise KvchatError(
                f"cannot load {path.name}: {why} (still on {self.name_of(back)})"
            ) from None
        return path

    def _release(self) -> None:
        """Finish the last turn's housekeeping (the settle and the snapshot write: a switch
        right after a reply must not leave the reply out of the session's KV, or coming back
        re-reads it), save the hot session, close the engine."""
        if self.host.loaded is not None:
            self.upkeep.run_pending()
        self.upkeep.abandon()  # what did not run (another process's turn): dropped
        self.host.release()

    # --- what each session ran with -----------------------------------------------------------

    def session_model(self, session_id: str) -> SessionModel | None:
        """The model ``session_id`` last ran with (None: no turn recorded one)."""
        row = self.store.get_session_model(session_id)
        if row is None:
            return None
        path = Path(row.model_path)
        loaded = self.loaded_model_path
        present = path.is_file()
        return SessionModel(
            path=path,
            # Named as now (a row from before store names held the blob's file name).
            name=self.name_of(path) if present else row.model_name,
            present=present,
            loaded=loaded is not None and same_file(path, loaded),
        )

    def other_model(self, session_id: str) -> SessionModel | None:
        """The model ``session_id`` was made with when it is here and is neither the loaded
        model nor, before any is loaded, the one the settings name (None otherwise)."""
        remembered = self.session_model(session_id)
        if remembered is None or not remembered.present or remembered.loaded:
            return None
        if self.settings.engine != LOCAL_ENGINE:
            return None
        if self.loaded_model_path is None:
            try:
                configured = model_path(self.settings)
            except KvchatError:
                return remembered
            if same_file(configured, remembered.path):
                return None
        return remembered

    def record(self, session_id: str) -> None:
        """Note the model a turn of ``session_id`` ran with (a convenience: a full disk is
        no error)."""
        path = self.loaded_model_path
        if path is None or self.settings.engine != LOCAL_ENGINE:
            return
        try:
            self.store.set_session_model(session_id, str(path.resolve()), self.loaded_name)
        except StoreFull:
            pass


class PlannerFit:
    """The planner's fit, with the GPU budget (and, for the CPU, the probe's measured speed)
    asked for once per list."""

    def __init__(self, settings: Settings, directory: Path | None = None) -> None:
        self.settings = settings
        self.budget: GpuBudget | None = find_budget(settings)
        self.offload = gpu_offload_supported() if self.budget is not None else False
        self.measured = measured_speed(directory)

    def fit(self, info: ModelInfo | None) -> str:
        if info is None:
            return "fit unknown"
        try:
            choice = plan_defaults(
                self.settings, info=info, budget=self.budget, offload=self.offload
            )
        except KvchatError as exc:
            return one_line(str(exc))
        if choice.device == "cpu":
            return cpu_fit(info, choice.n_ctx, self.measured, choice.type_k, choice.type_v).line()
        return fit_line(choice, info)


def _catalog_file(entry: CatalogEntry) -> Path | None:
    if entry.bundled:
        return bundled_model_path()
    path = models_dir() / entry.file
    return path if path.is_file() else None


def _read(path: Path) -> tuple[ModelInfo | None, str | None]:
    """The file's metadata, or why it cannot be read (shown in place of the fit)."""
    try:
        return read_gguf(path), None
    except KvchatError as exc:
        return None, one_line(str(exc))


def _estimate(entry: CatalogEntry) -> ModelInfo | None:
    try:
        return info_from_catalog(entry)
    except KvchatError:
        return None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None
