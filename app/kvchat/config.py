"""Settings and paths.

Precedence: command-line flag > ``KVCHAT_*`` environment > TOML config file > defaults.
``KVCHAT_HOME`` puts the database, snapshots and config file in one directory.
"""

from __future__ import annotations

import os
import re
import tomllib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvchat.errors import KvchatError
from kvchat.limits import (
    MAX_TOKENS_MIN,
    TEMPERATURE_MAX,
    TEMPERATURE_MIN,
    TOP_P_MAX,
    TOP_P_MIN,
)
from kvchat.paths import config_file
from kvchat.system import current as current_system

KvType = Literal["f16", "q8_0", "q4_0"]
# ``--model`` values that name the bundled model.
BUNDLED_ALIASES = ("bundled", "default")


def physical_cores() -> int:
    """Physical cores (llama.cpp is slower on hyper-threads); falls back to logical CPUs."""
    cores = current_system().cpu().physical_cores  # 0: the OS did not say
    return cores if cores > 0 else max(1, (os.cpu_count() or 2))


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


# An MCP server's name: it prefixes its tools' names (``server.tool``), so no dot, no path.
MCP_SERVER_NAME = r"^[A-Za-z0-9_-]{1,64}$"
MCP_MAX_SERVERS = 64


class McpServerConfig(BaseModel):
    """One ``[mcp.servers.NAME]`` entry: a stdio server (``command``) or a streamable-HTTP
    server (``url``), bounded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: str | None = Field(default=None, min_length=1, max_length=4096)
    args: list[str] = Field(default_factory=list, max_length=256)
    env: dict[str, str] = Field(default_factory=dict, max_length=256)
    url: str | None = Field(default=None, min_length=1, max_length=4096)
    headers: dict[str, str] = Field(default_factory=dict, max_length=64)
    enabled: bool = True
    approve: Literal["ask", "always"] = "ask"
    timeout_s: float = Field(default=60.0, ge=0.1, le=3600.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give either command (a stdio server) or url (an HTTP server)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        for text in [self.command or "", self.url or "", *self.args, *self.env, *self.env.values()]:
            if len(text) > 4096 or "\x00" in text:
                raise ValueError("a command, argument or variable holds NUL or is too long")
        return self


def _config_problem(exc: ValidationError) -> str:
    """A pydantic error as one line: where and what."""
    first = exc.errors()[0]
    message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    where = ".".join(str(part) for part in first.get("loc", ()))
    return f"{where}: {message}" if where else message


class McpSettings(BaseModel):
    """``[mcp.servers.NAME]`` tables. An entry that cannot be read does not stop kvchat: it
    is kept in ``problems`` as one line (shown by ``kvchat tools list``) and never started."""

    model_config = ConfigDict(extra="ignore")

    servers: dict[str, McpServerConfig] = Field(default_factory=dict)
    problems: dict[str, str] = Field(default_factory=dict)

    def summary(self) -> str:
        """The servers by name, for ``kvchat config`` (their env and headers may hold
        secrets: never printed; ``kvchat tools list`` shows each)."""
        if not self.servers and not self.problems:
            return "none"
        names = ", ".join(
            name + ("" if config.enabled else " (off)") for name, config in self.servers.items()
        )
        bad = f"{len(self.problems)} unreadable" if self.problems else ""
        return "; ".join(part for part in (names, bad) if part) + " (kvchat tools list)"

    @model_validator(mode="before")
    @classmethod
    def _each_server(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return {"problems": {"mcp": "[mcp] is not a table"}}
        raw = data.get("servers", {})
        servers: dict[str, Any] = {}
        problems: dict[str, str] = {}
        if not isinstance(raw, dict):
            return {"problems": {"mcp.servers": "[mcp.servers] is not a table"}}
        for index, (name, entry) in enumerate(raw.items()):
            label = name if isinstance(name, str) and re.fullmatch(MCP_SERVER_NAME, name) else None
            if index >= MCP_MAX_SERVERS:
                problems["mcp.servers"] = (
                    f"more than {MCP_MAX_SERVERS} servers; the rest are left out"
                )
                break
            if label is None:
                problems[f"server{index + 1}"] = (
                    "a server name must be 1-64 letters, digits, - or _ (it prefixes its tools)"
                )
                continue
            try:
                servers[label] = McpServerConfig.model_validate(entry)
            except ValidationError as exc:
                problems[label] = _config_problem(exc)
        return {"servers": servers, "problems": problems}


class Settings(BaseSettings):
    """Everything a user can configure."""

    model_config = SettingsConfigDict(
        env_prefix="KVCHAT_", env_nested_delimiter="__", extra="ignore"
    )

    model: str | None = Field(
        default=None,
        description="GGUF path, catalog name or store name (ollama:NAME; kvchat models list "
        "--local); default: the bundled SmolLM2-135M (F9's Ctrl+D saves one here)",
    )
    open_with_session_model: bool = Field(
        default=True,
        description="opening a session made with another model that is here loads that "
        "model (the app says so); false: keep the loaded model, the status line names it",
    )
    theme: str | None = Field(
        default=None,
        description="the app's colour theme (Ctrl+P, 'Change theme' saves it here); "
        "default: Textual's dark theme",
    )
    engine: str = Field(
        default="llama.cpp",
        description="what runs the model: llama.cpp (in this process), llama-server "
        "(at server_url; --server URL sets both) or openai (any OpenAI-compatible server "
        "at openai_url; --openai URL sets both)",
    )
    server_url: str | None = Field(
        default=None,
        description="llama-server to use with engine = llama-server, e.g. http://gpu-box:8080",
    )
    server_api_key: str | None = Field(
        default=None,
        description="API key of that llama-server (its --api-key), sent as a bearer token",
    )
    server_slot_dir: str | None = Field(
        default=None,
        description="that llama-server's slot directory (its --slot-save-path) where it is "
        "readable here: kvchat checksums each slot file and checks it before a restore; "
        "default: found by itself for a server on this machine; none: treat it as remote "
        "(each restore's KV is checked by the next-token figures it gives)",
    )
    openai_url: str | None = Field(
        default=None,
        description="OpenAI-compatible server to use with engine = openai (its /v1 base), "
        "e.g. http://127.0.0.1:8080/v1",
    )
    openai_api_key: str | None = Field(
        default=None,
        description="API key of that server, sent as a bearer token; set it in the "
        "environment (KVCHAT_OPENAI_API_KEY): kvchat never stores or prints it",
    )
    openai_model: str | None = Field(
        default=None,
        description="the model to ask that server for; default: the first it lists",
    )
    n_ctx: int = Field(default=8192, ge=64, description="context length in tokens")
    n_batch: int = Field(default=512, ge=1)
    n_threads: int | None = Field(
        default=None,
        ge=1,
        description="CPU threads for generation; default: the fastest count the engine "
        "probe measured on this machine (else the physical cores)",
    )
    n_threads_batch: int | None = Field(
        default=None,
        ge=1,
        description="CPU threads for prompt batches; default: the probe's fastest "
        "(n_threads when that is set)",
    )
    repack: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="llama.cpp's weight repacking (AMX/AVX-512 kernels); auto: on unless the "
        "engine probe saw llama.cpp crash with it on this machine, and off on an AMX CPU",
    )
    probe_timeout_s: float = Field(
        default=120.0,
        ge=1.0,
        le=3600.0,
        allow_inf_nan=False,
        description="how long the first load of a model on this machine waits for the engine "
        "probe; past it kvchat answers with weight repacking off while the probe finishes in "
        "the background",
    )
    n_gpu_layers: int = Field(
        default=-1, description="-1: every layer when llama.cpp has GPU offload"
    )
    type_k: KvType = "f16"
    type_v: KvType = "f16"
    flash_attn: bool = False
    swa_full: bool = Field(
        default=False,
        description="sliding-window models (Gemma 2/3, gpt-oss): keep every token in the "
        "window layers' KV too (~5x the KV on Gemma 3); default: a window's worth, with "
        "window checkpoints where conversations branch",
    )
    temperature: float = Field(default=0.7, ge=TEMPERATURE_MIN, le=TEMPERATURE_MAX)
    top_p: float = Field(default=0.95, gt=TOP_P_MIN, le=TOP_P_MAX)
    max_tokens: int = Field(default=512, ge=MAX_TOKENS_MIN)
    seed: int | None = Field(default=None, description="sampling seed; unset: a new one each turn")
    system_prompt: str | None = None
    chat_template: str | None = Field(
        default=None,
        description="chat template: chatml, gemma, llama3, mistral, phi3 or a Jinja file; "
        "default: the model's own (its GGUF's, else the catalog's, else ChatML with a notice)",
    )
    auto_title: bool = Field(
        default=True,
        description="after a session's first reply, the model names it (a few words, "
        "decoded beside the conversation: its KV is untouched); false: the first line",
    )
    overflow: Literal["compact", "drop"] = Field(
        default="compact",
        description="when a conversation outgrows the context: compact (offer a summary of "
        "the messages leaving the window, made by the model, to read instead of them) or "
        "drop (they leave the window unread; their text stays)",
    )
    ram_cache_mib: int = Field(
        default=1024, ge=0, description="warm tier: RAM for recent sessions' KV"
    )
    disk_cache_gib: float = Field(
        default=20.0, ge=0, description="cold tier: disk for KV snapshots"
    )
    chunk_tokens: int = Field(default=256, ge=16, description="tokens per KV snapshot chunk")
    snapshot_chunks: bool = Field(
        default=True, description="chunked snapshots (False: one whole-state file per session)"
    )
    model_dirs: list[str] = Field(
        default_factory=list,
        description="more folders of GGUF files to list and load from (read only), besides "
        "the stores of Ollama, LM Studio, Jan, GPT4All and the Hugging Face and llama.cpp "
        "caches, which are found on their own",
    )
    vram: str | None = Field(
        default=None,
        description="GPU memory to plan n_ctx/KV type/offload for (e.g. 6GiB); "
        "default: what NVML reports free, else no GPU",
    )
    detect_gpu: bool = Field(default=True, description="ask NVML (nvidia-ml-py) about the GPU")
    mcp: McpSettings = Field(
        default_factory=McpSettings,
        description="MCP tool servers: [mcp.servers.NAME] with command/args/env (stdio) or "
        "url/headers (streamable HTTP), enabled, approve (ask|always), timeout_s",
    )

    # Fields given as command-line flags (set by load_settings), to say where a value came from.
    _flags: set[str] = PrivateAttr(default_factory=set)

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

    @model_validator(mode="after")
    def _server_picks_engine(self) -> Settings:
        """A server URL given (flag, environment, file) without an engine picks its engine:
        openai for ``openai_url``, llama-server for ``server_url``."""
        if "engine" not in self.model_fields_set:
            if self.openai_url:
                self.engine = "openai"
            elif self.server_url:
                self.engine = "llama-server"
        return self

    def sources(self) -> dict[str, str]:
        """Where each field's value came from: flag, env KVCHAT_X, config file or default."""
        env = {name.lower() for name in os.environ}
        try:
            in_file = set(_TomlSource(type(self))())
        except KvchatError:
            in_file = set()
        result: dict[str, str] = {}
        for name in type(self).model_fields:
            env_name = f"KVCHAT_{name.upper()}"
            if name in self._flags:
                result[name] = "flag"
            elif env_name.lower() in env:
                result[name] = f"env {env_name}"
            elif name in in_file:
                result[name] = f"config file {config_file()}"
            elif name in self.model_fields_set:
                result[name] = "set"
            else:
                result[name] = "default"
        return result


def load_settings(**overrides: Any) -> Settings:
    """Settings with command-line ``overrides`` (None values ignored) on top."""
    given = {k: v for k, v in overrides.items() if v is not None}
    settings = Settings(**given)
    settings._flags = set(given) & set(Settings.model_fields)
    return settings
