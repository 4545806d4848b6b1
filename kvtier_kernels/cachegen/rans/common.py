"""The rANS bitstream that CacheGen's entropy coder writes, and what its two ops share.

Ops (one file each): ``rans_encode`` (:mod:`~kvtier_kernels.cachegen.rans.encode`) and
``rans_decode`` (:mod:`~kvtier_kernels.cachegen.rans.decode`). Each lane is an independent
rANS stream: 32-bit state in ``[2**16, 2**32)``, 16-bit renormalization, 16-bit
probabilities (``PROB_BITS = 16``), at most one word emitted per symbol. A lane's stream
is its final encoder state (low word, high word) followed by the renormalization words in
the order the decoder reads them; a decoded lane must end in the initial state
``RANS_LOW`` having read exactly its words, which catches most damage. A lane's ``n``
symbols are coded with ``g = tables_per_stream`` rows of ``freq``, in ``g`` runs of
``n / g`` (CacheGen codes several of its channels in one stream this way)::

    symbols   [lanes, n]      uint8; lane l's symbol i coded with freq[l * g + i // (n / g)]
    freq      [lanes * g, A]  int32/int64, rows sum to PROB_SCALE, A <= 255
    words     [sum(lengths)]  int32 holding 16-bit words: the lanes' streams concatenated
    lengths   [lanes]         int64, 2 <= lengths[l] <= n + 2

Each op's ``torch`` backend runs its numpy reference (vectorized across lanes, a loop over
the symbols of a lane) on CPU copies; ``triton`` runs its kernel compiled on CUDA/ROCm
tensors (one GPU thread per lane); ``interpret`` runs it under Triton's interpreter on CPU
tensors. Integer-only math (int64 state), so every backend gives the same bits by
construction.

This module holds the constants, :class:`CodecError`, the table checks every backend runs
(the numpy codec assumes valid tables), the errors every backend raises for bad symbols and
streams, and the launch parameters of both kernels (their launch plans are in
:mod:`~kvtier_kernels.cachegen.rans.plans`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import torch

from kvtier_kernels._launch import next_power_of_2

__all__ = [
    "FREQ_DTYPES",
    "MAX_ALPHABET",
    "PROB_BITS",
    "PROB_SCALE",
    "RANS_LOW",
    "CodecError",
    "LaunchConfig",
    "bad_table_rows",
    "check_freq",
    "check_placement",
    "check_same_device",
    "check_streams",
    "check_tables_per_stream",
    "checked_table",
    "first_lane",
    "launch_config",
    "raise_bad_streams",
    "raise_bad_table",
    "raise_length_mismatch",
    "raise_short_lanes",
    "raise_unusable_symbols",
]

PROB_BITS = 16
PROB_SCALE = 1 << PROB_BITS
RANS_LOW = 1 << 16  # lower bound of the state; the encoder starts and the decoder ends here
MAX_ALPHABET = 255
FREQ_DTYPES = (torch.int32, torch.int64)


class CodecError(ValueError):
    """A compressed chunk (payload or params) that is inconsistent and must not be used."""


# ---------------------------------------------------------------------------------------
# data checks shared by every backend (the numpy codec assumes valid tables)
# ---------------------------------------------------------------------------------------


def first_lane(flags: torch.Tensor) -> int:
    """The index of the first True in ``flags`` (one host sync)."""
    return int(flags.nonzero()[0, 0])


def bad_table_rows(freq: torch.Tensor) -> torch.Tensor:
    """bool ``[lanes]``: rows of ``freq`` that are not a probability table (on its device)."""
    return (freq.sum(1, dtype=torch.int64) != PROB_SCALE) | (freq < 0).any(1)


def checked_table(freq: torch.Tensor) -> np.ndarray:
    """``freq`` as a contiguous int64 numpy array on the CPU, checked as the references
    check it (numpy: no torch threads to wake for a CPU kernel).

    Raises:
        ValueError: as :func:`raise_bad_table`.
    """
    freq_cpu = freq.cpu()
    table = freq_cpu.to(torch.int64).contiguous().numpy()
    if table.size and table.min() >= 0 and (np.einsum("ij->i", table) == PROB_SCALE).all():
        return table  # the common case, in a fifth of the time of the row-wise checks below
    bad_rows = (table.sum(1) != PROB_SCALE) | (table < 0).any(1)
    if bad_rows.any():
        raise_bad_table(torch.from_numpy(bad_rows), freq_cpu)
    return table


def raise_bad_table(bad_rows: torch.Tensor, freq: torch.Tensor) -> NoReturn:
    """Raise the ValueError that names the first row of ``freq`` flagged in ``bad_rows``."""
    lane = first_lane(bad_rows)
    raise ValueError(
        f"freq row of lane {lane} must be non-negative and sum to PROB_SCALE={PROB_SCALE}; "
        f"it sums to {int(freq[lane].sum(dtype=torch.int64))} "
        f"({int(bad_rows.sum())} of {len(freq)} rows are bad)"
    )


def raise_unusable_symbols(bad_lanes: torch.Tensor) -> NoReturn:
    """Raise the ValueError of an encode whose lanes flagged in ``bad_lanes`` use a symbol
    outside their freq row or with frequency 0."""
    raise ValueError(
        f"lane {first_lane(bad_lanes)} uses a symbol outside its freq row or with frequency 0 "
        f"({int(bad_lanes.sum())} of {len(bad_lanes)} lanes); every symbol used needs a "
        "positive frequency"
    )


def raise_short_lanes(lengths: torch.Tensor) -> NoReturn:
    """Raise the CodecError that names the first lane of ``lengths`` with fewer than 2 words."""
    lane = first_lane(lengths < 2)
    raise CodecError(
        f"every lane needs at least its 2 state words; lane {lane} has {int(lengths[lane])}"
    )


def raise_length_mismatch(total: int, num_words: int) -> NoReturn:
    """Raise the CodecError of lane lengths summing to ``total`` for ``num_words`` words."""
    raise CodecError(f"lane lengths sum to {total}, stream has {num_words}")


def raise_bad_streams(bad_lanes: torch.Tensor) -> NoReturn:
    """Raise the CodecError that names the first lane flagged in ``bad_lanes``."""
    raise CodecError(
        f"rANS stream of lane {first_lane(bad_lanes)} is inconsistent "
        f"({int(bad_lanes.sum())} of {len(bad_lanes)} lanes)"
    )


def check_freq(freq: Any, lanes: int | None) -> None:
    """Check the type, dtype and shape of ``freq`` (``lanes`` rows unless None)."""
    if not isinstance(freq, torch.Tensor):
        raise TypeError(f"freq must be a torch.Tensor, got {type(freq).__name__}")
    if freq.dim() != 2 or freq.dtype not in FREQ_DTYPES:
        raise ValueError(
            f"freq must be a 2-D int32 or int64 tensor [lanes, A]; "
            f"got shape {tuple(freq.shape)} dtype {freq.dtype}"
        )
    if (lanes is not None and freq.shape[0] != lanes) or not 1 <= freq.shape[1] <= MAX_ALPHABET:
        raise ValueError(
            f"freq must have shape [lanes={lanes}, A] with 1 <= A <= {MAX_ALPHABET}; "
            f"got {tuple(freq.shape)}"
        )


def check_tables_per_stream(tables_per_stream: Any, n: int) -> None:
    """Raise ValueError unless ``tables_per_stream`` is an int >= 1 that divides ``n``."""
    g = tables_per_stream
    if type(g) is not int or g < 1 or n % g:
        raise ValueError(f"tables_per_stream must be an int >= 1 dividing n={n}; got {g!r}")


def check_streams(words: Any, lengths: Any, freq: Any, n: Any, tables_per_stream: Any) -> None:
    """Check the arguments of ``rans_decode_lanes``: the types, dtypes, shapes and device
    (ValueError / TypeError), then one length per lane (CodecError)."""
    for name, tensor in (("words", words), ("lengths", lengths)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 1 or tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name} must be a 1-D int32 or int64 tensor; "
                f"got shape {tuple(tensor.shape)} dtype {tensor.dtype}"
            )
    check_freq(freq, None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0; got {n!r}")
    check_tables_per_stream(tables_per_stream, n)
    check_same_device(words=words, lengths=lengths, freq=freq)
    if len(lengths) * tables_per_stream != len(freq):
        raise CodecError(
            f"every lane needs at least its 2 state words: {len(lengths)} lengths "
            f"for {len(freq) // tables_per_stream} lanes"
        )


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is on one device (the message lists them)."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device; got {devices}")


# ---------------------------------------------------------------------------------------
# launch parameters of both kernels
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Launch parameters of one rANS encode or decode launch.

    Attributes:
        block_lanes: lanes per program (``BLOCK``), a power of two; one lane per thread
            on a GPU.
        num_warps: warps per program, one of 1, 2, 4, 8, 16.
    """

    block_lanes: int
    num_warps: int


_GPU_MAX_BLOCK = 128  # lanes: 4 warps of 32 or 2 wavefronts of 64, one lane per thread
_GPU_MIN_PROGRAMS = 1024  # ~8 programs per SM on a 132-SM H100 before blocks grow
_INTERPRETER_MAX_BLOCK = 4096  # the interpreter pays per program and op: few, wide ones


def launch_config(lanes: int, device: torch.device, warp_size: int | None = None) -> LaunchConfig:
    """Launch parameters for coding ``lanes`` lanes on ``device`` (CPU means the
    interpreter): a built-in heuristic, the same for encode and decode.

    Each lane is a serial chain of dependent loads and int64 divisions, so a GPU wants many
    resident warps rather than wide ones: one lane per thread, blocks of one warp
    (``warp_size`` lanes: 32 on NVIDIA and RDNA, 64 on CDNA; default: the device's)
    growing to 128 lanes only while that still leaves at least 1024 programs. Under the
    interpreter every program costs about a millisecond per op: one program for up to
    4096 lanes. (Not in the tuning files: ``kvtier tune`` has no rANS problem yet.)
    """
    if device.type != "cuda":
        return LaunchConfig(min(next_power_of_2(max(1, lanes)), _INTERPRETER_MAX_BLOCK), 1)
    if warp_size is None:
        warp_size = getattr(torch.cuda.get_device_properties(device), "warp_size", 32)
    block = warp_size
    while block < _GPU_MAX_BLOCK and lanes >= 2 * block * _GPU_MIN_PROGRAMS:
        block *= 2
    return LaunchConfig(block, block // warp_size)


def check_placement(device: torch.device, interpret: bool) -> None:
    """Raise ValueError when the kernel could not reach tensors on ``device``."""
    if interpret and device.type != "cpu":
        raise ValueError(
            f"kernel backend 'interpret' runs on CPU tensors; the tensors are on {device} "
            "(use 'triton' for GPU tensors)"
        )
    if not interpret and device.type != "cuda":
        raise ValueError(
            f"kernel backend 'triton' needs CUDA/ROCm tensors; the tensors are on {device} "
            "(use 'interpret' or 'torch')"
        )
