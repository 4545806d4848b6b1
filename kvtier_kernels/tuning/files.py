"""The per-device tuning files: which ops are tunable, how files are named, and how they
are read and checked. The search path, the lookup the launchers call and the writing of
files are in :mod:`~kvtier_kernels.tuning.lookup`; the sweep that makes them is
:mod:`~kvtier_kernels.tuning.sweep` (used only by ``kvtier tune``).

Files: one per (op, backend, device, dtype), named::

    op=<op>,backend=<backend>,device=<device name>,dtype=<dtype>.json

The device name is ``torch.cuda.get_device_name()`` with every run of characters other
than ``[A-Za-z0-9.+-]`` replaced by ``_`` (``NVIDIA_H100_80GB_HBM3``), or ``cpu`` for the
interpreter. The paged copies move rows as integer words (bf16, fp16 and fp8 rows alike),
so their files are named by the *word* type the launcher picks (``int64`` whenever a head
row is a multiple of 8 bytes); RoPE files by the storage dtype of the keys. The format is
in ``docs/kernels.md``; :class:`TuningFile` reads, checks and writes it.

Each op file declares its :class:`Tunable` with :func:`register_tunable`; this module
imports no op file, no triton, and touches no GPU driver.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier_kernels.dtypes import dtype_name

SCHEMA_VERSION = 1
"""Value of the ``kvtier_tuning`` field; a file with another value is ignored."""

NUM_WARPS = (1, 2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class Tunable:
    """What the tuning file of one op holds.

    Attributes:
        op: registry op name.
        key_fields: shape fields an entry must match exactly.
        nearest_field: a shape field matched to the entry with the closest value (log2
            distance, ties to the smaller), or None.
        config_fields: the launch parameters (the fields of the op's ``LaunchConfig``):
            powers of two; ``num_warps`` one of :data:`NUM_WARPS`.
    """

    op: str
    key_fields: tuple[str, ...]
    nearest_field: str | None
    config_fields: tuple[str, ...]

    @property
    def shape_fields(self) -> tuple[str, ...]:
        return self.key_fields + ((self.nearest_field,) if self.nearest_field else ())


TUNABLES: dict[str, Tunable] = {}
"""Every op that has tunable launch parameters, in the order their op files registered."""


def register_tunable(tunable: Tunable) -> Tunable:
    """Declare ``tunable`` (called by its op file at import); return it.

    Raises:
        ValueError: another declaration for the same op.
    """
    if TUNABLES.get(tunable.op, tunable) != tunable:
        raise ValueError(f"op {tunable.op!r} is already tunable as {TUNABLES[tunable.op]}")
    TUNABLES[tunable.op] = tunable
    return tunable


# ---------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------

_UNSAFE = re.compile(r"[^A-Za-z0-9.+-]+")


def file_prefix(op: str, backend: str, device: str) -> str:
    """What the names of the tuning files of (op, backend, device name) start with; the
    dtype and ``.json`` follow."""
    slug = _UNSAFE.sub("_", device).strip("_") or "unknown"
    return f"op={op},backend={backend},device={slug},dtype="


def file_name(op: str, backend: str, device: str, dtype: torch.dtype | str) -> str:
    """The file name of the tuning file for (op, backend, device name, dtype)."""
    return f"{file_prefix(op, backend, device)}{dtype_name(dtype)}.json"


@functools.lru_cache(maxsize=1)
def _cuda_available() -> bool:
    return torch.cuda.is_available()


@functools.cache
def gpu_name(index: int) -> str:
    """What tuning files are keyed by: on ROCm the architecture (``gfx942``, the feature
    flags of ``gcnArchName`` dropped: marketing names vary by driver and are often a bare
    "AMD Radeon Graphics"), on CUDA the device name (``NVIDIA H100 80GB HBM3``)."""
    if torch.version.hip:
        arch = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "") or ""
        if arch.split(":")[0]:
            return arch.split(":")[0]
    return torch.cuda.get_device_name(index) or f"gpu{index}"


def device_name(device: torch.device | str) -> str | None:
    """The name tuning files use for ``device``: :func:`gpu_name`, ``"cpu"`` for the CPU
    (the interpreter), None for anything else or a GPU device without a GPU present.

    NOTE: for a GPU this initialises CUDA/HIP (a launcher calling it is about to launch on
    that device anyway); it never does for a GPU device when torch sees no GPU.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda" or not _cuda_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return gpu_name(index)


# ---------------------------------------------------------------------------------------
# the file format
# ---------------------------------------------------------------------------------------


class TuningFileError(ValueError):
    """A tuning file that cannot be used: unreadable, malformed, or for another op,
    backend, device or dtype than expected."""


@dataclass(slots=True)
class TuningEntry:
    """The best launch parameters found for one shape key.

    Attributes:
        key: the op's shape fields (``Tunable.shape_fields``), e.g. ``{"row_words": 256}``.
        config: the launch parameters (``Tunable.config_fields``).
        median_us: median time of ``config`` (informational, as are the rest).
        gbps: bytes read plus written per second at ``median_us``, in GB/s.
        heuristic_us: median time of the built-in heuristic's config, same run.
        candidates: candidates that passed the reference check and were timed.
        rejected: candidates that failed the check (or to compile / run).
        shape: what was timed (layout, layers, tokens, cache dtype, where the chunk was).
    """

    key: dict[str, int]
    config: dict[str, int]
    median_us: float | None = None
    gbps: float | None = None
    heuristic_us: float | None = None
    candidates: int = 0
    rejected: int = 0
    shape: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class CopyEngineFigures:
    """Where a copy-engine transfer beats the kernel, for one direction.

    Attributes:
        direction: ``"device_to_host"`` (gather into pinned memory vs ``copy_`` of the
            pages) or ``"host_to_device"`` (scatter vs ``copy_`` into the pages).
        crossover_bytes: the smallest contiguous run of pages (bytes, one layer) from which
            on ``copy_(non_blocking=True)`` was faster than the kernel at every size
            measured; None when the kernel won at the largest size.
        points: ``{"bytes", "kernel_us", "copy_us"}`` per size measured, ascending.
        shape: what was measured (layout, block bytes, ...).
    """

    direction: str
    crossover_bytes: int | None
    points: list[dict[str, float]]
    shape: dict[str, Any] = field(default_factory=dict)


_MISS = object()


@dataclass(slots=True)
class TuningFile:
    """One tuning file: the entries of one (op, backend, device, dtype)."""

    op: str
    backend: str
    device: str
    dtype: str
    entries: list[TuningEntry]
    copy_engine: CopyEngineFigures | None = None
    versions: dict[str, str] = field(default_factory=dict)
    created: str = ""
    path: Path | None = None
    _matches: dict[tuple[int, ...], dict[str, int] | None] = field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def name(self) -> str:
        return file_name(self.op, self.backend, self.device, self.dtype)

    def match(self, key: Mapping[str, int]) -> dict[str, int] | None:
        """The launch parameters for ``key`` (every ``Tunable.shape_fields`` field), or
        None when no entry matches its exact fields. The result is cached: do not modify it.
        """
        tunable = TUNABLES[self.op]
        wanted = tuple(int(key[f]) for f in tunable.shape_fields)
        hit = self._matches.get(wanted, _MISS)
        if hit is _MISS:
            hit = self._matches[wanted] = self._find(tunable, key)
        return hit  # type: ignore[return-value]

    def _find(self, tunable: Tunable, key: Mapping[str, int]) -> dict[str, int] | None:
        same = [e for e in self.entries if all(e.key[f] == key[f] for f in tunable.key_fields)]
        if not same:
            return None
        near = tunable.nearest_field
        if near is None:
            return same[0].config
        target = max(1, int(key[near]))
        best = min(same, key=lambda e: (abs(math.log2(e.key[near] / target)), e.key[near]))
        return best.config

    def merged_over(self, old: TuningFile) -> TuningFile:
        """This file, plus the entries of ``old`` for shape keys it lacks (sorted by key), and
        ``old``'s copy-engine figures when it has none."""
        fields = TUNABLES[self.op].shape_fields
        new_keys = {tuple(e.key[f] for f in fields) for e in self.entries}
        kept = [e for e in old.entries if tuple(e.key[f] for f in fields) not in new_keys]
        return dataclasses.replace(
            self,
            entries=sorted(kept + self.entries, key=lambda e: tuple(e.key[f] for f in fields)),
            copy_engine=self.copy_engine or old.copy_engine,
            _matches={},
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON document (see ``docs/kernels.md``)."""
        return {
            "kvtier_tuning": SCHEMA_VERSION,
            "op": self.op,
            "backend": self.backend,
            "device": self.device,
            "dtype": self.dtype,
            "created": self.created,
            "versions": dict(self.versions),
            "entries": [dataclasses.asdict(e) for e in self.entries],
            "copy_engine": None
            if self.copy_engine is None
            else dataclasses.asdict(self.copy_engine),
        }

    @classmethod
    def from_json(cls, data: Any, path: Path | None = None) -> TuningFile:
        """Check and read a JSON document. Raises :class:`TuningFileError`."""
        if not isinstance(data, dict):
            raise TuningFileError(f"expected a JSON object, got {type(data).__name__}")
        if data.get("kvtier_tuning") != SCHEMA_VERSION:
            raise TuningFileError(
                f"kvtier_tuning is {data.get('kvtier_tuning')!r}; this kvtier reads "
                f"version {SCHEMA_VERSION}"
            )
        for name in ("op", "backend", "device", "dtype"):
            if not isinstance(data.get(name), str) or not data[name]:
                raise TuningFileError(f"{name!r} must be a non-empty string")
        op = data["op"]
        if op not in TUNABLES:
            raise TuningFileError(f"unknown op {op!r}; tunable ops: {sorted(TUNABLES)}")
        tunable = TUNABLES[op]
        raw_entries = data.get("entries")
        if not isinstance(raw_entries, list):
            raise TuningFileError("'entries' must be a list")
        entries, seen = [], set()
        for i, raw in enumerate(raw_entries):
            entry = _read_entry(tunable, raw, f"entries[{i}]")
            shape_key = tuple(entry.key[f] for f in tunable.shape_fields)
            if shape_key in seen:
                raise TuningFileError(f"entries[{i}]: duplicate key {entry.key}")
            seen.add(shape_key)
            entries.append(entry)
        copy_engine = data.get("copy_engine")
        if copy_engine is not None:
            copy_engine = _read_copy_engine(copy_engine)
        versions = data.get("versions") or {}
        if not isinstance(versions, dict):
            raise TuningFileError("'versions' must be an object")
        return cls(
            op=op,
            backend=data["backend"],
            device=data["device"],
            dtype=data["dtype"],
            entries=entries,
            copy_engine=copy_engine,
            versions={str(k): str(v) for k, v in versions.items()},
            created=str(data.get("created", "")),
            path=path,
        )

    def check_identity(self, op: str, backend: str, device: str, dtype: str) -> None:
        """Raise :class:`TuningFileError` unless the file is for exactly these."""
        for what, got, want in (
            ("op", self.op, op),
            ("backend", self.backend, backend),
            ("device", self.device, device),
            ("dtype", self.dtype, dtype),
        ):
            if got != want:
                raise TuningFileError(f"it is for {what} {got!r}, not {want!r}")


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TuningFileError(f"{where} must be a positive integer; got {value!r}")
    return value


def _read_entry(tunable: Tunable, raw: Any, where: str) -> TuningEntry:
    if not isinstance(raw, dict):
        raise TuningFileError(f"{where} must be an object")
    key, config = raw.get("key"), raw.get("config")
    if not isinstance(key, dict) or set(key) != set(tunable.shape_fields):
        raise TuningFileError(f"{where}.key must have exactly the fields {tunable.shape_fields}")
    if not isinstance(config, dict) or set(config) != set(tunable.config_fields):
        raise TuningFileError(
            f"{where}.config must have exactly the fields {tunable.config_fields}"
        )
    for name, value in key.items():
        _positive_int(value, f"{where}.key.{name}")
    for name, value in config.items():
        _positive_int(value, f"{where}.config.{name}")
        if value & (value - 1):
            raise TuningFileError(f"{where}.config.{name} must be a power of two; got {value}")
    if config["num_warps"] not in NUM_WARPS:
        raise TuningFileError(f"{where}.config.num_warps must be one of {NUM_WARPS}")
    known = {f.name for f in dataclasses.fields(TuningEntry)}
    extra = {k: v for k, v in raw.items() if k in known and k not in ("key", "config")}
    try:
        return TuningEntry(key=dict(key), config=dict(config), **extra)
    except TypeError as error:
        raise TuningFileError(f"{where}: {error}") from None


def _read_copy_engine(raw: Any) -> CopyEngineFigures:
    if not isinstance(raw, dict):
        raise TuningFileError("'copy_engine' must be an object or null")
    crossover = raw.get("crossover_bytes")
    if crossover is not None:
        _positive_int(crossover, "copy_engine.crossover_bytes")
    points = raw.get("points", [])
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise TuningFileError("copy_engine.points must be a list of objects")
    direction = raw.get("direction")
    if direction not in ("device_to_host", "host_to_device"):
        raise TuningFileError(f"copy_engine.direction {direction!r} is not a known direction")
    return CopyEngineFigures(direction, crossover, points, dict(raw.get("shape") or {}))


def load_tuning_file(path: str | Path) -> TuningFile:
    """Read and check the tuning file at ``path``; its identity must match its name.

    Raises:
        TuningFileError: unreadable, not JSON, malformed, or its content disagrees with
            its file name.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TuningFileError(f"cannot read it: {error}") from None
    tuning_file = TuningFile.from_json(data, path)
    if path.name != tuning_file.name:
        raise TuningFileError(f"its content is for {tuning_file.name!r}")
    return tuning_file
