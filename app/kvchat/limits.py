"""The allowed ranges of the sampling settings, in one place for the CLI, the config and the app.

Plain values and one check with a message meant for users; nothing here imports a UI
or a settings library, so every layer can use it.
"""

from __future__ import annotations

TEMPERATURE_MIN = 0.0  # 0: greedy decoding
TEMPERATURE_MAX = 2.0
TOP_P_MIN = 0.0  # exclusive: top_p must be more than this
TOP_P_MAX = 1.0
MAX_TOKENS_MIN = 1  # and at most the context length (n_ctx)
SEED_MIN = 0

# How each range reads in a hint or a placeholder.
RANGE_TEXT = {
    "temperature": f"{TEMPERATURE_MIN:g}–{TEMPERATURE_MAX:g}",
    "top_p": f"over {TOP_P_MIN:g}, up to {TOP_P_MAX:g}",
    "max_tokens": f"{MAX_TOKENS_MIN}–context length",
    "seed": f"{SEED_MIN} or more",
}


def sampling_problem(name: str, value: float, n_ctx: int | None = None) -> str | None:
    """Why ``value`` is not allowed for the sampling setting ``name``, or None if it is.

    ``n_ctx`` (the context length) bounds ``max_tokens`` when it is known.
    """
    if name == "temperature" and not TEMPERATURE_MIN <= value <= TEMPERATURE_MAX:
        return (
            f"temperature must be from {TEMPERATURE_MIN:g} to {TEMPERATURE_MAX:g} "
            f"(0: greedy), not {value:g}"
        )
    if name == "top_p" and not TOP_P_MIN < value <= TOP_P_MAX:
        return f"top_p must be more than {TOP_P_MIN:g} and at most {TOP_P_MAX:g}, not {value:g}"
    if name == "max_tokens":
        if value != int(value) or value < MAX_TOKENS_MIN:
            return f"max_tokens must be a whole number, at least {MAX_TOKENS_MIN}, not {value:g}"
        if n_ctx is not None and value > n_ctx:
            return (
                f"max_tokens must be at most the context length ({n_ctx:,} tokens), "
                f"not {int(value):,}"
            )
    if name == "seed" and (value != int(value) or value < SEED_MIN):
        return f"seed must be a whole number, {SEED_MIN} or more, not {value:g}"
    return None
