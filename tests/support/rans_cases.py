"""Shared cases of the rANS coder tests: valid lanes, damaged streams, and assertions that
say where a mismatch is (``tests/test_cachegen_kernels.py``, ``tests/test_rans_numba.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvtier_kernels.cachegen import quantize_counts
from kvtier_kernels.cachegen.rans import PROB_SCALE, CodecError

DISTRIBUTIONS = ["uniform", "skewed", "dense"]


def make_lanes(
    lanes: int, n: int, alphabet: int, distribution: str, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(symbols uint8 [lanes, n], freq uint32 [lanes, alphabet])``, a valid pair.

    ``uniform``/``skewed`` (geometric) symbols are coded with their own histogram, so most
    of a large alphabet has frequency 0; ``dense`` gives every symbol a frequency (counts
    of another stream), as a table shared between streams would.
    """
    rng = np.random.default_rng(seed)
    if distribution == "skewed":
        symbols = np.minimum(rng.geometric(0.6, size=(lanes, n)) - 1, alphabet - 1)
    else:
        symbols = rng.integers(0, alphabet, size=(lanes, n))
    symbols = symbols.astype(np.uint8)
    if distribution == "dense":
        counts = rng.integers(1, 50, size=(lanes, alphabet))
    else:
        counts = np.stack([np.bincount(row, minlength=alphabet) for row in symbols])
        counts[counts.sum(1) == 0, 0] = 1  # n = 0: any valid table
    freq = quantize_counts(counts)
    assert (freq.sum(1) == PROB_SCALE).all()
    return symbols, freq


def as_tensors(
    symbols: np.ndarray, freq: np.ndarray, freq_dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(symbols.copy()), torch.from_numpy(freq.astype(np.int64)).to(freq_dtype)


def assert_stream_equal(
    words: torch.Tensor, lengths: torch.Tensor, ref_words: np.ndarray, ref_lengths: np.ndarray
) -> None:
    """Equal lengths and words; a mismatch names the lane and word where it is."""
    assert words.dtype == torch.int32 and lengths.dtype == torch.int64
    got_lengths = lengths.cpu().numpy()
    bad = np.flatnonzero(got_lengths != ref_lengths)
    assert not bad.size, (
        f"lane {bad[0]}: {got_lengths[bad[0]]} words, expected {ref_lengths[bad[0]]}"
    )
    got = words.cpu().numpy()
    assert got.shape == ref_words.shape, f"{got.shape[0]} words, expected {ref_words.shape[0]}"
    diff = np.flatnonzero(got != ref_words.astype(np.int32))
    if diff.size:
        lane = int(np.searchsorted(np.cumsum(ref_lengths), diff[0], side="right"))
        start = int(np.cumsum(ref_lengths)[lane] - ref_lengths[lane])
        pytest.fail(
            f"lane {lane} word {diff[0] - start}: {got[diff[0]]}, expected {ref_words[diff[0]]}"
        )


def outcome(decode: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", symbols as numpy)`` or ``(exception type name, message)``."""
    try:
        result = decode()
    except (CodecError, ValueError) as error:
        return type(error).__name__, str(error)
    return "ok", result.cpu().numpy() if isinstance(result, torch.Tensor) else result


def assert_same_outcome(expected: tuple[str, Any], got: tuple[str, Any]) -> None:
    """Both decoded the same symbols, or both raised the same error type with the
    reference's message (a short lane's message goes on to name the lane)."""
    assert got[0] == expected[0], f"reference: {expected}, kernel: {got}"
    if got[0] == "ok":
        np.testing.assert_array_equal(got[1], expected[1])
    else:
        assert got[1].startswith(expected[1]), f"reference: {expected}, kernel: {got}"


def damage_cases() -> list[tuple[str, Callable]]:
    """(name, damage): damage(words, lengths, freq, n) -> the same four, damaged."""

    def flip(at: int, bit: int) -> Callable:
        def damage(words, lengths, freq, n):
            words = words.copy()
            words[at % len(words)] ^= np.uint16(1 << bit)
            return words, lengths, freq, n

        return damage

    def other_table(seed: int) -> Callable:
        def damage(words, lengths, freq, n):
            return words, lengths, make_lanes(len(lengths), 40, freq.shape[1], "dense", seed)[1], n

        return damage

    def shift_lengths(words, lengths, freq, n):
        return words, lengths + np.array([1, -1, 0, 0, 0]), freq, n

    def short_lane(words, lengths, freq, n):
        lengths = lengths.copy()
        lengths[2] += lengths[1] - 1
        lengths[1] = 1
        return words, lengths, freq, n

    def cut_last_lane(words, lengths, freq, n):
        return words[:-1], lengths - np.array([0, 0, 0, 0, 1]), freq, n

    def drop_last_lane(words, lengths, freq, n):
        return words[: -int(lengths[-1])], lengths[:-1], freq[:-1], n

    def swap_lanes(words, lengths, freq, n):
        return words, lengths, freq[[1, 0, 2, 3, 4]], n

    return [
        *[
            (f"flip word {at} bit {bit}", flip(at, bit))
            for at in (0, 1, 5, 17, -1)
            for bit in (0, 9)
        ],
        ("truncate one word", lambda w, le, f, n: (w[:-1], le, f, n)),
        ("last lane one word short", cut_last_lane),
        ("last lane dropped (valid)", drop_last_lane),
        ("extra word", lambda w, le, f, n: (np.append(w, np.uint16(7)), le, f, n)),
        ("lengths +1 -1", shift_lengths),
        ("lane of 1 word", short_lane),
        ("lengths all +1", lambda w, le, f, n: (w, le + 1, f, n)),
        ("other table 1", other_table(1)),
        ("other table 2", other_table(2)),
        ("tables of two lanes swapped", swap_lanes),
        ("one symbol fewer", lambda w, le, f, n: (w, le, f, n - 1)),
        ("one symbol more", lambda w, le, f, n: (w, le, f, n + 1)),
        ("no symbols", lambda w, le, f, n: (w, le, f, 0)),
    ]


DAMAGES = damage_cases()
