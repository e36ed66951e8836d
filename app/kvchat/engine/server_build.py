"""llama-server for the llama-server engine: where its binary is, how to build it, how to run it.

The binary is built from the llama.cpp tree vendored in the sdist of the installed
llama-cpp-python (so its state format is the local engine's), static, and kept per
version in the user cache directory: ``<cache>/kvchat/llama-server/<version>/llama-server``.
Building is an explicit user action (``kvchat server build``): it downloads the sdist
from PyPI with pip; nothing else in kvchat touches the network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import platformdirs

from kvchat.config import Settings
from kvchat.errors import KvchatError
from kvchat.paths import data_dir, ensure_private_dir

BINARY_NAME = "llama-server"
# Overrides where the binary is looked for (a llama-server built some other way).
BINARY_ENV = "KVCHAT_LLAMA_SERVER"
CMAKE_FLAGS = (
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DCMAKE_BUILD_TYPE=Release",
)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_SLOTS = 4


def llama_cpp_version() -> str:
    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        raise KvchatError("llama-cpp-python is not installed") from None


def cached_binary_path(llama_version: str | None = None) -> Path:
    """Where ``kvchat server build`` puts the binary for this llama-cpp-python version."""
    cache = platformdirs.user_cache_path("kvchat")
    return cache / "llama-server" / (llama_version or llama_cpp_version()) / BINARY_NAME


def find_binary() -> Path | None:
    """The llama-server to run: ``$KVCHAT_LLAMA_SERVER``, else the cached build, else None."""
    override = os.environ.get(BINARY_ENV)
    if override:
        return Path(override).expanduser()
    path = cached_binary_path()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def slot_save_dir() -> Path:
    """kvchat's own directory for a local server's slot files (private, like the data dir)."""
    return data_dir() / "server-slots"


@dataclass(frozen=True)
class ServerPlan:
    """The llama-server command line that fits these settings and model."""

    binary: str
    model: Path
    host: str
    port: int
    slots: int
    n_ctx: int  # per slot
    type_k: str
    type_v: str
    flash_attn: bool
    # llama-server's --swa-full: sliding-window layers keep every cell, not a window's worth
    # (only for a sliding-window model whose settings ask for it, as the in-process engine).
    swa: bool
    slot_dir: Path
    n_gpu_layers: int
    api_key_env: bool = False
    # False: llama-server's --no-repack (the engine probe saw llama.cpp crash with repacked
    # weights on this machine, or repack = "off").
    repack: bool = True

    def argv(self) -> list[str]:
        args = [
            self.binary,
            "--model",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--parallel",
            str(self.slots),
            "--ctx-size",
            str(self.n_ctx * self.slots),
            "--cache-type-k",
            self.type_k,
            "--cache-type-v",
            self.type_v,
            "--flash-attn",
            "on" if self.flash_attn else "off",
            "--slot-save-path",
            f"{self.slot_dir}{os.sep}",
            "--n-gpu-layers",
            "all" if self.n_gpu_layers < 0 else str(self.n_gpu_layers),
            "--no-webui",
        ]
        if self.swa:
            args.append("--swa-full")
        if not self.repack:
            args.append("--no-repack")
        return args

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        shown = "127.0.0.1" if host == "0.0.0.0" else host
        return f"http://{shown}:{self.port}"


def plan_server(
    settings: Settings,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    slots: int = DEFAULT_SLOTS,
    slot_dir: Path | None = None,
) -> ServerPlan:
    """The command line for the settings' model, context per slot and KV types."""
    from kvchat.planner.gguf_info import read_gguf
    from kvchat.planner.model_lookup import model_path

    if slots < 1:
        raise KvchatError("a llama-server needs at least one slot (--slots 1 or more)")
    model = model_path(settings)
    swa = False
    if settings.swa_full:
        try:
            swa = read_gguf(model).sliding_window > 0
        except KvchatError:
            pass
    binary = find_binary()
    from kvchat.engine.factory import engine_config
    from kvchat.engine.probe import probed_config

    # The server runs the llama.cpp this llama-cpp-python vendors, on this CPU: what the
    # probe found for the in-process engine holds for it too.
    repack = probed_config(engine_config(settings, model), repack=settings.repack)[0].repack
    return ServerPlan(
        binary=str(binary) if binary is not None else BINARY_NAME,
        model=model,
        host=host,
        port=port,
        slots=slots,
        n_ctx=settings.n_ctx,
        type_k=settings.type_k,
        type_v=settings.type_v,
        flash_attn=settings.flash_attn or settings.type_v != "f16",
        swa=swa,
        slot_dir=slot_dir or slot_save_dir(),
        n_gpu_layers=settings.n_gpu_layers,
        repack=repack is not False,
    )


def prepare_slot_dir(path: Path) -> Path:
    """The slot directory, created private (0700) when kvchat makes it."""
    return ensure_private_dir(path)


def build_binary(
    *,
    jobs: int | None = None,
    work: Path | None = None,
    say: Callable[[str], None] = print,
    source: Path | None = None,
) -> Path:
    """Build llama-server from the installed llama-cpp-python's sdist into the cache.

    ``source``: an sdist (.tar.gz) already at hand instead of downloading it with pip.
    Returns the installed binary's path. Needs cmake and a C++ compiler.
    """
    llama_version = llama_cpp_version()
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None and not (tool == "c++" and shutil.which("g++")):
            raise KvchatError(f"building llama-server needs {tool} on PATH")
    scratch = Path(tempfile.mkdtemp(prefix="kvchat-llama-server-", dir=work))
    try:
        if source is None:
            say(f"downloading the llama-cpp-python {llama_version} sdist from PyPI (pip)…")
            _run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    f"llama-cpp-python=={llama_version}",
                    "--no-binary",
                    "llama-cpp-python",
                    "--no-deps",
                    "-d",
                    str(scratch),
                ],
                "pip download",
            )
            found = sorted(scratch.glob("llama_cpp_python-*.tar.gz"))
            if not found:
                raise KvchatError("pip downloaded no llama-cpp-python sdist")
            source = found[0]
        say(f"unpacking {source.name}…")
        with tarfile.open(source) as archive:
            archive.extractall(scratch / "src", filter="data")
        trees = list((scratch / "src").glob("*/vendor/llama.cpp"))
        if not trees:
            raise KvchatError(f"{source.name} holds no vendor/llama.cpp tree")
        build = scratch / "build"
        say(f"configuring (cmake {' '.join(CMAKE_FLAGS)})…")
        say(
            "  built for this CPU (llama.cpp's GGML_NATIVE default); weight repacking is on "
            "unless the server is started with --no-repack, which `kvchat server` adds "
            "where the engine probe saw llama.cpp crash with it"
        )
        _run(["cmake", "-S", str(trees[0]), "-B", str(build), *CMAKE_FLAGS], "cmake")
        cores = jobs or max(1, os.cpu_count() or 1)
        say(f"building llama-server with {cores} jobs (about 15 minutes on 2 cores)…")
        _run(
            ["cmake", "--build", str(build), "--target", BINARY_NAME, "-j", str(cores)],
            "cmake --build",
        )
        return install_binary(build / "bin" / BINARY_NAME, llama_version)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def install_binary(built: Path, llama_version: str | None = None) -> Path:
    """Copy a built llama-server into the cache (atomically: a temporary name, then rename)."""
    if not built.is_file():
        raise KvchatError(f"no llama-server binary at {built}")
    target = cached_binary_path(llama_version)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{BINARY_NAME}.partial")
    shutil.copyfile(built, partial)
    os.chmod(partial, 0o755)
    os.replace(partial, target)
    return target


def _run(argv: list[str], what: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise KvchatError(f"{what} could not start: {exc.strerror or exc}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise KvchatError(f"{what} failed (exit {done.returncode}): {' / '.join(tail)}")
