"""The model choices the app offers: catalog, local and bundled models with the planner's
fit, the fit line, and the picker's key in the key table."""

from __future__ import annotations

from pathlib import Path

from kvchat.planner.defaults import GpuBudget, plan_defaults
from kvchat.planner.gguf_info import read_gguf
from kvchat.service.chat import ChatService
from kvchat.service.model_choices import fit_line
from kvchat.tui.keys import KEYS
from tests.e2e.tui.test_model_switch import TINY, bundled, settings, tiny

__all__ = ["tiny"]  # fixtures shared with the module they come from
FIT_PREFIXES = ("fits: ", "partly fits: ", "CPU: ", "too big for the RAM free: ")


# ------------------------------------------------------------------------- the service


def test_choices_list_catalog_local_and_bundled_models_with_their_fit(tiny: Path) -> None:
    service = ChatService(settings())
    try:
        choices = service.models.model_choices()
    finally:
        service.close()
    by_path = {c.path.resolve(): c for c in choices if c.path is not None}
    smol = by_path[bundled().resolve()]
    assert smol.source == "bundled" and smol.size_bytes == bundled().stat().st_size
    assert smol.fit.startswith(FIT_PREFIXES), smol.fit
    local = by_path[tiny.resolve()]
    assert (local.name, local.source) == (f"{TINY}.gguf", "local")
    assert local.fit.startswith(FIT_PREFIXES), local.fit
    assert len(by_path) == len([c for c in choices if c.path is not None])  # each file once
    missing = [c for c in choices if c.path is None]
    assert missing, "the catalog lists models that are not downloaded here"
    for choice in missing:
        assert choice.pull_hint == f"not downloaded: kvchat models pull {choice.name}"
        assert choice.fit.startswith(FIT_PREFIXES), choice.fit  # planned from the catalog
    assert not any(c.loaded for c in choices)  # nothing loaded yet


def test_the_fit_line_says_where_the_plan_puts_the_model(kvhome: Path) -> None:
    info = read_gguf(bundled())
    budget = GpuBudget("flag", 6 * 2**30)
    on_gpu = plan_defaults(settings(n_ctx=8192), info=info, budget=budget, offload=True)
    assert fit_line(on_gpu, info) == "fits: 8k context, all layers on the GPU"
    on_cpu = plan_defaults(settings(n_ctx=8192), info=info, budget=None)
    assert fit_line(on_cpu, info) == "CPU only: 8k context"


def test_the_picker_has_a_key_in_the_table() -> None:
    key = next(k for k in KEYS if k.action == "pick_model")
    assert key.palette and key.keys
