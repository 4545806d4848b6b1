"""The keys of CacheBlend (``enable_blending`` and the ``blend_*`` keys, LMCache's names):
reuse of the cached KV of separator-delimited text segments that are not a prefix
(docs/cacheblend.md).

``blend_problems`` is the cross-key check ``KVTierConfig`` runs; ``blend_schedule`` is
what the vLLM connector reads.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvtier.config.keys import KeySpec, empty_as


def _number_list_text(default: str) -> Any:
    """A normalizer: a list of numbers (or one number) as comma-separated text; text is
    kept; an empty list (LMCache's way of leaving the key unset) is ``default``."""
    return lambda value: default if value == [] or value == () else _list_text(value)


def _list_text(value: Any) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list | tuple) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
    ):
        return ",".join(str(v) for v in value)
    return value.replace(" ", "") if isinstance(value, str) else value


def parse_ratios(text: str) -> list[float]:
    """``blend_recompute_ratios`` as floats (raises ValueError when it is not a list of
    numbers from 0 to 1)."""
    ratios = [float(part) for part in text.split(",")] if text else []
    if not ratios or not all(0.0 <= r <= 1.0 for r in ratios):
        raise ValueError(text)
    return ratios


def parse_check_layers(text: str) -> list[int]:
    """``blend_check_layers`` as layer indices (raises ValueError when they are not
    integers >= 0)."""
    layers = [int(part) for part in text.split(",")] if text else []
    if not layers or any(layer < 0 for layer in layers):
        raise ValueError(text)
    return layers


def _valid(parse) -> Any:
    def check(text: str) -> bool:
        try:
            parse(text)
        except ValueError:
            return False
        return True

    return check


# CacheBlend's keys, LMCache's names.
BLEND: tuple[KeySpec, ...] = (
    KeySpec(
        "enable_blending",
        bool,
        False,
        "CacheBlend (vLLM connector): store the KV of each separator-delimited segment of "
        "a prompt on its own, and reuse it wherever the segment appears in a later prompt "
        "(keys re-rotated to the new positions, the most deviating tokens recomputed). "
        "Needs a RoPE decoder without sliding window, MLA or hybrid layers.",
        lmcache_names=("enable_blending",),
    ),
    KeySpec(
        "blend_special_str",
        str,
        " # # ",
        "CacheBlend: the separator text between segments, tokenized with the engine's "
        "tokenizer (without special tokens).",
        normalize=empty_as(" # # "),
        allowed="a string (empty: the default)",
        lmcache_names=("blend_special_str",),
    ),
    KeySpec(
        "blend_recompute_ratios",
        str,
        "0.15",
        "CacheBlend: the fraction of reused tokens recomputed (those whose KV deviates most "
        "at the check layer); one ratio, or one per check layer (non-increasing).",
        normalize=_number_list_text("0.15"),
        check=_valid(parse_ratios),
        allowed="a number from 0 to 1, or a comma-separated list of them",
        lmcache_names=("blend_recompute_ratios", "blend_recompute_ratio"),
    ),
    KeySpec(
        "blend_check_layers",
        str,
        "0",
        "CacheBlend: the layer(s) where the KV deviation is measured and the tokens to "
        "recompute are picked (0 is the first layer); layers before the first one are "
        "recomputed for every token.",
        normalize=_number_list_text("0"),
        check=_valid(parse_check_layers),
        allowed="an integer >= 0, or a comma-separated increasing list of them",
        lmcache_names=("blend_check_layers",),
    ),
    KeySpec(
        "blend_min_tokens",
        int,
        256,
        "CacheBlend: segments shorter than this many tokens are neither stored nor reused.",
        check=lambda v: v >= 1,
        allowed="an integer >= 1",
        lmcache_names=("blend_min_tokens",),
    ),
)


class BlendSettings(Protocol):
    """The blend keys that the cross-key check and the schedule read (a ``KVTierConfig``)."""

    blend_recompute_ratios: str
    blend_check_layers: str


def blend_problems(config: BlendSettings) -> list[str]:
    """Cross-key problems of the blend keys (each names the keys and the fix)."""
    try:
        ratios = parse_ratios(config.blend_recompute_ratios)
        layers = parse_check_layers(config.blend_check_layers)
    except (TypeError, ValueError):
        return []  # already reported by the key's own check
    problems = []
    if layers != sorted(set(layers)):
        problems.append(
            f"blend_check_layers: {config.blend_check_layers!r} must list distinct layers in "
            "increasing order"
        )
    if len(ratios) not in (1, len(layers)):
        problems.append(
            f"blend_recompute_ratios: {config.blend_recompute_ratios!r} gives {len(ratios)} "
            f"ratios for {len(layers)} check layers ({config.blend_check_layers!r}); give one "
            "ratio, or one per check layer"
        )
    elif ratios != sorted(ratios, reverse=True):
        problems.append(
            f"blend_recompute_ratios: {config.blend_recompute_ratios!r} must not increase "
            "from one check layer to the next (a later check narrows the earlier choice)"
        )
    return problems


def blend_schedule(config: BlendSettings) -> list[tuple[int, float]]:
    """``(check layer, ratio)`` pairs of a valid config, in layer order."""
    layers = parse_check_layers(config.blend_check_layers)
    ratios = parse_ratios(config.blend_recompute_ratios)
    if len(ratios) == 1:
        ratios = ratios * len(layers)
    return list(zip(layers, ratios, strict=True))
