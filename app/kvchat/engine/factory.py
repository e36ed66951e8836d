"""Choose and open an engine from the settings; implementations are imported only when chosen."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.engine.api import Engine, EngineConfig
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.config import Settings

# Setting value → "module:class". Every engine class opens through its
# ``from_settings(settings, config)`` classmethod (a server engine reads its URL and key there).
ENGINES: dict[str, str] = {
    "llama.cpp": "kvchat.engine.llama:LlamaEngine",
    "llama-server": "kvchat.engine.server:ServerEngine",
    "openai": "kvchat.engine.openai:OpenAIEngine",
}
# The engines that run the model file here (the others use the one their server has open).
LOCAL_ENGINES = frozenset({"llama.cpp"})
# EngineConfig fields that the settings hold under the same names.
_FROM_SETTINGS = (
    "n_ctx",
    "n_batch",
    "n_threads",
    "n_gpu_layers",
    "type_k",
    "type_v",
    "flash_attn",
    "swa_full",
    "chat_template",
)


def engine_config(settings: Settings, model_path: Path) -> EngineConfig:
    """The context settings of ``settings`` (already planned for this machine).

    Unset thread counts become the physical cores, and ``repack`` "auto" becomes None
    (the engine asks the probe): :func:`kvchat.engine.probe.probed_config` decides both
    first where the service opens the engine.
    """
    from kvchat.config import physical_cores

    values = {name: getattr(settings, name) for name in _FROM_SETTINGS}
    threads = settings.n_threads or physical_cores()
    values["n_threads"] = threads
    values["n_threads_batch"] = settings.n_threads_batch or threads
    values["repack"] = None if settings.repack == "auto" else settings.repack == "on"
    return EngineConfig(model_path, **values)


def create_engine(
    settings: Settings, model_path: Path | None = None, *, config: EngineConfig | None = None
) -> Engine:
    """Open the engine named by ``settings.engine`` on ``model_path`` (default: the settings'),
    with ``config`` when given (the probe's choice) instead of the settings' own."""
    target = ENGINES.get(settings.engine)
    if target is None:
        raise KvchatError(f"unknown engine {settings.engine!r}; known: {', '.join(ENGINES)}")
    module, name = target.split(":")
    opener = getattr(import_module(module), name).from_settings
    if config is None:
        if model_path is None and settings.engine in LOCAL_ENGINES:
            from kvchat.planner.model_lookup import model_path as named_model

            model_path = named_model(settings)
        config = engine_config(settings, model_path or Path(settings.model or ""))
    opened: Engine = opener(settings, config)
    return opened
