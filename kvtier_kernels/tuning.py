"""Per-device launch parameters for the Triton kernels: the files, their lookup at run
time, and the sweep that writes them (``kvtier tune``).

Every Triton launcher asks its op's ``launch_config(...)`` for tile sizes and warps; that
function first calls :func:`tuned_config` here, and an entry of a matching per-device JSON
file wins over the op's built-in heuristic. There is no ``@triton.autotune``: its
first-call benchmarking would stall a serving engine. The files are written ahead of time
by :func:`tune`, which checks every candidate against the torch reference (bit-exact for
copies, within a stated tolerance for RoPE) before timing it.

Files: one per (op, backend, device, dtype), named::

    op=<op>,backend=<backend>,device=<device name>,dtype=<dtype>.json

The device name is ``torch.cuda.get_device_name()`` with every run of characters other
than ``[A-Za-z0-9.+-]`` replaced by ``_`` (``NVIDIA_H100_80GB_HBM3``), or ``cpu`` for the
interpreter. The paged copies move rows as integer words (bf16, fp16 and fp8 rows alike),
so their files are named by the *word* type the launcher picks (``int64`` whenever a head
row is a multiple of 8 bytes); RoPE files by the storage dtype of the keys. The format is
in ``docs/kernels.md``; :class:`TuningFile` reads, checks and writes it.

Search path, first match wins (a later file for the same name is shadowed):

1. the directories in ``KVTIER_TUNING_DIR`` (``os.pathsep``-separated), else
   ``$XDG_CACHE_HOME/kvtier/tuning`` (``~/.cache/kvtier/tuning``): what ``kvtier tune``
   writes;
2. ``kvtier_kernels/tuned/``: defaults shipped with the package, when present.

:func:`set_search_path` replaces both. A file that cannot be read, is malformed, or is for
another op, backend, device or dtype than its name says is skipped with a warning (once)
and the search goes on; nothing here ever raises into a launcher.

Importing this module imports neither triton nor the op modules, and touches no GPU driver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier_kernels.layouts import PagedKV, get_layout

__all__ = [
    "PACKAGED_DIR",
    "SCHEMA_VERSION",
    "TUNABLES",
    "TUNING_DIR_ENV",
    "CopyEngineFigures",
    "FileStatus",
    "ModelShape",
    "PagedCopyProblem",
    "ProblemResult",
    "RopeProblem",
    "TuneReport",
    "TuningEntry",
    "TuningFile",
    "TuningFileError",
    "TuningProblem",
    "build_problems",
    "clear_cache",
    "default_user_dir",
    "device_name",
    "event_timer",
    "file_name",
    "files_in_effect",
    "find_crossover",
    "find_tuning_file",
    "load_tuning_file",
    "measure_copy_engine",
    "model_shape_from_config",
    "paged_copy_candidates",
    "parse_dtype",
    "read_model_config",
    "rope_candidates",
    "run_problems",
    "save_tuning_file",
    "search_path",
    "set_search_path",
    "tune",
    "tune_problem",
    "tuned_config",
]

SCHEMA_VERSION = 1
"""Value of the ``kvtier_tuning`` field; a file with another value is ignored."""

TUNING_DIR_ENV = "KVTIER_TUNING_DIR"
PACKAGED_DIR = Path(__file__).resolve().parent / "tuned"
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


_PAGED_FIELDS = ("block_tokens", "block_row", "num_warps")
TUNABLES: dict[str, Tunable] = {
    # launch_config(op, row_words, word_dtype, device): a row of words is all it sees.
    "paged_gather": Tunable("paged_gather", ("row_words",), None, _PAGED_FIELDS),
    "paged_scatter": Tunable("paged_scatter", ("row_words",), None, _PAGED_FIELDS),
    # launch_config(half_rotary, num_tokens, dtype, device)
    "rope_rerotate": Tunable(
        "rope_rerotate",
        ("half_rotary",),
        "num_tokens",
        ("block_tokens", "block_pairs", "num_warps"),
    ),
}
"""Every op that has tunable launch parameters."""


# ---------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------

_UNSAFE = re.compile(r"[^A-Za-z0-9.+-]+")


def _slug(name: str) -> str:
    return _UNSAFE.sub("_", name).strip("_") or "unknown"


def dtype_name(dtype: torch.dtype | str) -> str:
    """``"bfloat16"`` for ``torch.bfloat16`` (a string passes through)."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def file_name(op: str, backend: str, device: str, dtype: torch.dtype | str) -> str:
    """The file name of the tuning file for (op, backend, device name, dtype)."""
    return f"op={op},backend={backend},device={_slug(device)},dtype={dtype_name(dtype)}.json"


@functools.lru_cache(maxsize=1)
def _cuda_available() -> bool:
    return torch.cuda.is_available()


@functools.cache
def _gpu_name(index: int) -> str:
    name = torch.cuda.get_device_name(index)
    if not name and torch.version.hip:  # some ROCm builds report an empty marketing name
        name = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "")
    return name or f"gpu{index}"


def device_name(device: torch.device | str) -> str | None:
    """The name tuning files use for ``device``: the GPU's name, ``"cpu"`` for the CPU
    (the interpreter), None for anything else or a GPU device without a GPU present.

    NOTE: for a GPU this initialises CUDA/HIP (a launcher calling it is about to launch on
    that device anyway); :func:`tuned_config` never calls it for a GPU that is not there.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda" or not _cuda_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _gpu_name(index)


def _backend_for(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "interpret"


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


def save_tuning_file(tuning_file: TuningFile, directory: str | Path, *, merge: bool = True) -> Path:
    """Write ``tuning_file`` into ``directory`` (created if missing) atomically; return the path.

    With ``merge``, entries of a valid existing file for other shape keys are kept (and its
    copy-engine figures, when the new file has none). Lookups see the new file at once.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / tuning_file.name
    if merge and path.exists():
        try:
            old = load_tuning_file(path)
        except TuningFileError as error:
            warnings.warn(f"replacing unusable tuning file {path}: {error}", stacklevel=2)
        else:
            fields = TUNABLES[tuning_file.op].shape_fields
            new_keys = {tuple(e.key[f] for f in fields) for e in tuning_file.entries}
            kept = [e for e in old.entries if tuple(e.key[f] for f in fields) not in new_keys]
            tuning_file = dataclasses.replace(
                tuning_file,
                entries=sorted(
                    kept + tuning_file.entries,
                    key=lambda e: tuple(e.key[f] for f in fields),
                ),
                copy_engine=tuning_file.copy_engine or old.copy_engine,
                _matches={},
            )
    text = json.dumps(tuning_file.to_json(), indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    clear_cache()
    return path


# ---------------------------------------------------------------------------------------
# search path and lookup
# ---------------------------------------------------------------------------------------

_lock = threading.Lock()
_override: tuple[Path, ...] | None = None
_loaded: dict[tuple[Any, ...], TuningFile | None] = {}


def default_user_dir() -> Path:
    """``$XDG_CACHE_HOME/kvtier/tuning``, or ``~/.cache/kvtier/tuning``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / "tuning"


def user_dirs() -> tuple[Path, ...]:
    """Where ``kvtier tune`` writes and lookups look first (see the module doc)."""
    env = os.environ.get(TUNING_DIR_ENV)
    if env:
        return tuple(Path(p).expanduser() for p in env.split(os.pathsep) if p)
    return (default_user_dir(),)


@functools.lru_cache(maxsize=32)
def _search_path(
    override: tuple[Path, ...] | None, packaged: Path, *environment: str | None
) -> tuple[Path, ...]:
    del environment  # part of the cache key only
    if override is not None:
        return override
    return (*user_dirs(), packaged)


def search_path() -> tuple[Path, ...]:
    """The directories searched for tuning files, first match wins."""
    return _search_path(
        _override,
        PACKAGED_DIR,
        os.environ.get(TUNING_DIR_ENV),
        os.environ.get("XDG_CACHE_HOME"),
        os.environ.get("HOME"),
    )


def set_search_path(directories: Sequence[str | Path] | None) -> None:
    """Search exactly ``directories`` (packaged defaults included only if listed); None
    restores the default (``KVTIER_TUNING_DIR`` or the user cache, then packaged)."""
    global _override
    _override = None if directories is None else tuple(Path(d).expanduser() for d in directories)
    clear_cache()


def clear_cache() -> None:
    """Forget every file read so far (they are read again on the next lookup)."""
    with _lock:
        _loaded.clear()


def find_tuning_file(
    op: str, backend: str, device: str, dtype: torch.dtype | str
) -> TuningFile | None:
    """The tuning file in effect for (op, backend, device name, dtype), or None.

    The first usable file along :func:`search_path` wins; an unusable one is skipped with
    a ``RuntimeWarning`` (once per process, until :func:`clear_cache`). Never raises for a
    bad file.
    """
    dtype = dtype_name(dtype)
    dirs = search_path()
    cache_key = (dirs, op, backend, device, dtype)
    with _lock:
        if cache_key in _loaded:
            return _loaded[cache_key]
        found = None
        name = file_name(op, backend, device, dtype)
        for directory in dirs:
            path = directory / name
            if not path.is_file():
                continue
            try:
                tuning_file = load_tuning_file(path)
                tuning_file.check_identity(op, backend, device, dtype)
            except TuningFileError as error:
                warnings.warn(
                    f"ignoring tuning file {path}: {error}; using the next file on the search "
                    "path or the built-in heuristics",
                    RuntimeWarning,
                    stacklevel=3,
                )
                continue
            found = tuning_file
            break
        _loaded[cache_key] = found
        return found


def tuned_config(
    op: str, device: torch.device, dtype: torch.dtype, key: Mapping[str, int]
) -> dict[str, int] | None:
    """The tuned launch parameters for ``op`` on ``device``, or None (use the heuristics).

    Called by the launchers on every launch (cached after the first). ``device`` decides
    the backend: a CUDA/ROCm device means ``triton``, the CPU means ``interpret``.
    ``dtype`` is the dtype the op's files are named by; ``key`` holds the op's
    ``Tunable.shape_fields``. Never raises: a problem is a warning and None.
    """
    if device.type == "cuda" and not _cuda_available():
        return None  # e.g. a heuristic asked about a GPU this machine does not have
    try:
        name = device_name(device)
        if name is None:
            return None
        tuning_file = find_tuning_file(op, _backend_for(device), name, dtype)
        return None if tuning_file is None else tuning_file.match(key)
    except Exception as error:  # never break a launch over a tuning file
        warnings.warn(
            f"tuning lookup for {op} failed ({error!r}); using the built-in heuristics",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


@dataclass(frozen=True, slots=True)
class FileStatus:
    """One tuning file on the search path, as ``kvtier kernels`` shows it.

    Attributes:
        path: the file.
        dtype: the dtype its name says.
        status: ``"in effect"``, ``"shadowed"`` (an earlier directory has the same name)
            or ``"ignored"`` (unusable; ``detail`` says why).
        detail: entries and copy-engine crossover, or the reason it is ignored.
    """

    path: Path
    dtype: str
    status: str
    detail: str


def files_in_effect(op: str, backend: str, device: str) -> list[FileStatus]:
    """Every tuning file of (op, backend, device name) on the search path, any dtype."""
    prefix = f"op={op},backend={backend},device={_slug(device)},dtype="
    statuses: list[FileStatus] = []
    in_effect: set[str] = set()
    for directory in search_path():
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob(f"{prefix}*.json")):
            dtype = path.name[len(prefix) : -len(".json")]
            if dtype in in_effect:
                statuses.append(FileStatus(path, dtype, "shadowed", "an earlier directory wins"))
                continue
            try:
                tuning_file = load_tuning_file(path)
                tuning_file.check_identity(op, backend, device, dtype)
            except TuningFileError as error:
                statuses.append(FileStatus(path, dtype, "ignored", str(error)))
                continue
            in_effect.add(dtype)
            count = len(tuning_file.entries)
            detail = f"{count} shape{'' if count == 1 else 's'}"
            figures = tuning_file.copy_engine
            if figures is not None:
                crossover = figures.crossover_bytes
                detail += (
                    f"; copy engine wins from {_format_bytes(crossover)} runs"
                    if crossover is not None
                    else "; copy engine never won"
                )
            statuses.append(FileStatus(path, dtype, "in effect", detail))
    return statuses


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------
# model shapes
# ---------------------------------------------------------------------------------------

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
for _alias, _attr in (
    ("float8_e4m3fn", "float8_e4m3fn"),
    ("fp8", "float8_e4m3fn"),
    ("fp8_e4m3", "float8_e4m3fn"),
    ("float8_e5m2", "float8_e5m2"),
    ("fp8_e5m2", "float8_e5m2"),
):
    if hasattr(torch, _attr):
        _DTYPES[_alias] = getattr(torch, _attr)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` / ``"bfloat16"`` / ``"torch.bfloat16"`` -> ``torch.bfloat16``, and so on.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower().removeprefix("torch.")
    try:
        return _DTYPES[key]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r}; known: {', '.join(_DTYPES)}") from None


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The KV geometry of one model as a serving engine's paged cache holds it.

    Attributes:
        num_layers, num_kv_heads, head_size: the cache's geometry (MLA: one head of the
            latent dim, e.g. 576).
        block_size: tokens per engine block.
        chunk_size: tokens per kvtier chunk (what one gather/scatter/RoPE launch moves).
        dtype: the KV cache dtype.
        layout: the engine layout name (``kvtier_kernels.layouts.LAYOUTS``).
        rotary_dim: dims of each head that RoPE rotates; None means ``head_size``; 0 means
            nothing to re-rotate (MLA, models without RoPE).
        name: a label for progress output.

    Raises:
        ValueError: a non-positive size, an unknown layout, MLA with more than one head, or
            a rotary dim that is odd or larger than the head.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int = 16
    chunk_size: int = 256
    dtype: torch.dtype = torch.bfloat16
    layout: str = "vllm_nhd"
    rotary_dim: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        layout = get_layout(self.layout)  # raises for an unknown name
        if layout.kv_planes == 1 and self.num_kv_heads != 1:
            raise ValueError(
                f"layout {self.layout!r} holds one latent head; num_kv_heads must be 1"
            )
        rotary = self.rotary_dim
        if rotary is not None and (rotary < 0 or rotary % 2 or rotary > self.head_size):
            raise ValueError(
                f"rotary_dim must be an even number in [0, head_size={self.head_size}]; got {rotary}"
            )

    @property
    def rope_dim(self) -> int:
        """Dims that RoPE rotates per head (0: no RoPE re-rotation for this model)."""
        return self.head_size if self.rotary_dim is None else self.rotary_dim

    def describe(self) -> str:
        label = f"{self.name}: " if self.name else ""
        return (
            f"{label}{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_size}, "
            f"{dtype_name(self.dtype)}, block {self.block_size}, chunk {self.chunk_size}, "
            f"layout {self.layout}, rotary dim {self.rope_dim or 'none'}"
        )


def _first(config: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


def read_model_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`ModelShape` fields a HuggingFace-style ``config.json`` determines.

    ``source`` is the file, a model directory holding ``config.json``, or the parsed dict.
    Reads ``num_hidden_layers``, ``num_key_value_heads`` (default: the attention heads;
    ``multi_query``: 1), ``head_dim`` (default ``hidden_size // num_attention_heads``),
    ``torch_dtype`` / ``dtype``, ``partial_rotary_factor`` / ``rotary_pct`` /
    ``rotary_dim``; a ``text_config`` (multimodal models) is used in place of the top
    level; MLA models (``kv_lora_rank``) get the ``mla`` layout, one head of
    ``kv_lora_rank + qk_rope_head_dim`` and no RoPE re-rotation.

    Raises:
        ValueError: unreadable, or a required field is missing (the message names it).
    """
    if isinstance(source, Mapping):
        config: Any = dict(source)
        where = "model config"
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        where = str(path)
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read model config {where}: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object")
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**config, **text}

    fields: dict[str, Any] = {}
    name = _first(config, "_name_or_path", "model_type")
    if name:
        fields["name"] = str(name)
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    if layers is None:
        raise ValueError(f"{where}: no num_hidden_layers")
    fields["num_layers"] = int(layers)
    dtype = _first(config, "torch_dtype", "dtype")
    if isinstance(dtype, str):
        with contextlib.suppress(ValueError):  # e.g. "auto": --dtype or the default decides
            fields["dtype"] = parse_dtype(dtype)

    if config.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3): one latent plane
        fields.update(
            layout="mla",
            num_kv_heads=1,
            head_size=int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0),
            rotary_dim=0,
        )
        return fields

    heads = _first(config, "num_attention_heads", "n_head")
    if heads is None:
        raise ValueError(f"{where}: no num_attention_heads")
    kv_heads = _first(config, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv_heads is None:
        kv_heads = 1 if config.get("multi_query") else heads
    head_size = config.get("head_dim")
    if head_size is None:
        hidden = _first(config, "hidden_size", "n_embd", "d_model")
        if hidden is None:
            raise ValueError(f"{where}: no head_dim and no hidden_size")
        head_size = int(hidden) // int(heads)
    fields.update(num_kv_heads=int(kv_heads), head_size=int(head_size))
    rotary = config.get("rotary_dim")
    factor = _first(config, "partial_rotary_factor", "rotary_pct")
    if rotary is None and factor is not None:
        rotary = int(int(head_size) * float(factor))
    if rotary is not None:
        fields["rotary_dim"] = int(rotary) // 2 * 2
    return fields


def model_shape_from_config(source: str | Path | Mapping[str, Any], **overrides: Any) -> ModelShape:
    """A :class:`ModelShape` from a model config (:func:`read_model_config`), with
    ``overrides`` (ModelShape fields; None values are ignored) taking precedence."""
    fields = read_model_config(source)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return ModelShape(**fields)


# ---------------------------------------------------------------------------------------
# candidates
# ---------------------------------------------------------------------------------------


def _powers_of_two(low: int, high: int) -> list[int]:
    """Powers of two in ``[low, high]``."""
    powers, p = [], 1
    while p <= high:
        if p >= low:
            powers.append(p)
        p *= 2
    return powers


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _warps_for(elements: int, quick: bool) -> list[int]:
    """Warps that give every thread 1 to 32 of a tile's ``elements`` (quick: 4 or 8)."""
    fitting = [w for w in NUM_WARPS if 32 * w <= elements <= 1024 * w] or [1]
    if quick:
        fitting = [w for w in fitting if w in (4, 8)] or fitting[:1]
    return fitting


def paged_copy_candidates(
    row_words: int, word_bytes: int, num_tokens: int, *, quick: bool = False
) -> list[Any]:
    """Launch configs to try for a paged copy of ``row_words``-word rows.

    Rows split into ``BLOCK_R`` words (down to 8 words, or the whole row when smaller),
    ``BLOCK_T`` from 1 to 64 tokens (at most the chunk), tiles of 256 B to 32 KiB, and
    warps for 1 to 32 words per thread. ``quick``: 4 or 8 warps and every other token count.
    """
    from kvtier_kernels.paged_copy import LaunchConfig

    full_row = _next_power_of_2(row_words)
    token_cap = min(64, _next_power_of_2(num_tokens))
    token_choices = _powers_of_two(1, token_cap)
    if quick:
        token_choices = sorted({*token_choices[::2], token_cap})
    smallest = min(256, full_row * token_cap * word_bytes)  # tiny problems: one whole tile
    configs = []
    for block_row in _powers_of_two(min(8, full_row), full_row):
        for block_tokens in token_choices:
            elements = block_row * block_tokens
            if not smallest <= elements * word_bytes <= 32768:
                continue
            for num_warps in _warps_for(elements, quick):
                configs.append(LaunchConfig(block_tokens, block_row, num_warps))
    return configs


def rope_candidates(half_rotary: int, num_tokens: int, *, quick: bool = False) -> list[Any]:
    """Launch configs to try for re-rotating ``half_rotary`` pairs per head.

    ``BLOCK_P`` from 8 pairs (or the whole head when smaller) to the whole head,
    ``BLOCK_T`` from 1 to 128 tokens (at most the chunk), tiles of 64 to 8192 pairs, and
    warps for 1 to 32 pairs per thread. ``quick``: 4 or 8 warps and every other token count.
    """
    from kvtier_kernels.rope import LaunchConfig

    all_pairs = _next_power_of_2(half_rotary)
    token_cap = min(128, _next_power_of_2(num_tokens))
    token_choices = _powers_of_two(1, token_cap)
    if quick:
        token_choices = sorted({*token_choices[::2], token_cap})
    smallest = min(64, all_pairs * token_cap)  # tiny problems: one whole tile
    configs = []
    for block_pairs in _powers_of_two(min(8, all_pairs), all_pairs):
        for block_tokens in token_choices:
            pairs = block_pairs * block_tokens
            if not smallest <= pairs <= 8192:
                continue
            for num_warps in _warps_for(pairs, quick):
                configs.append(LaunchConfig(block_tokens, block_pairs, num_warps))
    return configs


# ---------------------------------------------------------------------------------------
# problems: one op at one shape, its inputs, and the reference check
# ---------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _fill_random_bits_(t: torch.Tensor, generator: torch.Generator) -> None:
    """Random bytes into ``t`` (any strides, any device; NaN payloads and all)."""
    raw = t.view(torch.int8) if t.dim() and t.stride(-1) == 1 else _bits(t)
    info = torch.iinfo(raw.dtype)
    values = torch.randint(info.min, info.max + 1, raw.shape, generator=generator, dtype=raw.dtype)
    raw.copy_(values)


def _alloc_chunk(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, chunk_memory: str
) -> torch.Tensor:
    if device.type == "cuda" and chunk_memory == "pinned":
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_difference(got: torch.Tensor, want: torch.Tensor, dims: str) -> str | None:
    """None when ``got`` and ``want`` hold the same bits, else where they first differ."""
    if got.device == want.device and torch.equal(_bits(got), _bits(want)):
        return None
    diff = _bits(got).cpu() != _bits(want).cpu()
    if not bool(diff.any()):
        return None
    where = ", ".join(f"{d} {int(i)}" for d, i in zip(dims.split(), diff.nonzero()[0], strict=True))
    return f"{int(diff.sum())} elements differ from the torch reference; first at {where}"


class TuningProblem:
    """One op at one shape: the candidates to try and how to run and check one.

    Subclasses allocate in :meth:`setup` and free in :meth:`teardown`, so that problems
    are held in memory one at a time. They run the op's registered implementation for
    their backend, or the ``impl`` they were given (same signature, with ``config=``).

    Attributes:
        op: registry op name.
        dtype: the dtype the op's tuning file is named by.
        key: the shape key of the entry this problem produces.
        candidates: the launch configs to try (the heuristic's is always among them).
        heuristic: the built-in heuristic's config for this shape.
        bytes_moved: bytes read plus written by one launch (for GB/s).
        shape: what is timed (informational, written into the entry).
    """

    op: str
    dtype: torch.dtype
    key: dict[str, int]
    candidates: list[Any]
    heuristic: Any
    bytes_moved: int
    shape: dict[str, Any]

    def setup(self) -> None:
        raise NotImplementedError

    def run(self, config: Any) -> None:
        """Launch once with ``config`` (asynchronous on a GPU)."""
        raise NotImplementedError

    def check(self, config: Any) -> str | None:
        """Reset the inputs, run with ``config``, compare with the reference: None when it
        matches, else where it differs."""
        raise NotImplementedError

    def teardown(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.op} " + " ".join(f"{k}={v}" for k, v in self.key.items())


def _with_heuristic(candidates: list[Any], heuristic: Any) -> list[Any]:
    return candidates if heuristic in candidates else [heuristic, *candidates]


class PagedCopyProblem(TuningProblem):
    """``paged_gather`` or ``paged_scatter`` of one chunk, every layer in one launch.

    The cache is filled with random bits and ``chunk_size`` tokens sit in random blocks.
    Each candidate is checked bit for bit against the torch reference on that slot mapping
    and on the same with every 7th slot negative (skipped).
    """

    def __init__(
        self,
        op: str,
        shape: ModelShape,
        device: torch.device,
        backend: str,
        *,
        chunk_memory: str = "pinned",
        quick: bool = False,
        seed: int = 0,
        impl: Callable[..., Any] | None = None,
    ) -> None:
        from kvtier_kernels import paged_copy

        if op not in ("paged_gather", "paged_scatter"):
            raise ValueError(f"PagedCopyProblem is for paged_gather / paged_scatter, not {op!r}")
        if chunk_memory not in ("pinned", "device"):
            raise ValueError(f"chunk_memory must be 'pinned' or 'device'; got {chunk_memory!r}")
        self.op, self.model, self.device, self.backend = op, shape, torch.device(device), backend
        self.chunk_memory, self.seed, self._impl = chunk_memory, seed, impl
        blocks_per_chunk = -(-shape.chunk_size // shape.block_size)
        self.num_blocks = max(4 * blocks_per_chunk, 16)
        # The word type and row length the launcher will see, from a small CPU replica
        # with the same layout, geometry and strides (checked again on the real tensors).
        replica = self._cache("cpu", num_layers=min(2, shape.num_layers))
        chunk = torch.empty(replica.chunk_shape(1, replica.num_layers), dtype=shape.dtype)
        self.word_bytes = self._word_bytes(replica, chunk)
        self.row_words = (
            shape.num_kv_heads * shape.head_size * shape.dtype.itemsize // self.word_bytes
        )
        word_dtype = paged_copy._WORD_OF_BYTES[self.word_bytes]
        self.dtype = word_dtype
        self.key = {"row_words": self.row_words}
        heuristic = paged_copy.launch_config(
            op, self.row_words, word_dtype, self.device, tuned=False
        )
        # What the launcher really launches: it caps BLOCK_T at the tokens there are.
        token_cap = _next_power_of_2(shape.chunk_size)
        self.heuristic = dataclasses.replace(
            heuristic, block_tokens=min(heuristic.block_tokens, token_cap)
        )
        self.candidates = _with_heuristic(
            paged_copy_candidates(self.row_words, self.word_bytes, shape.chunk_size, quick=quick),
            self.heuristic,
        )
        kv = get_layout(shape.layout).kv_planes
        row_bytes = shape.num_kv_heads * shape.head_size * shape.dtype.itemsize
        self.bytes_moved = 2 * kv * shape.num_layers * shape.chunk_size * row_bytes
        self.shape = {
            "layout": shape.layout,
            "num_layers": shape.num_layers,
            "num_tokens": shape.chunk_size,
            "block_size": shape.block_size,
            "num_kv_heads": shape.num_kv_heads,
            "head_size": shape.head_size,
            "cache_dtype": dtype_name(shape.dtype),
            "chunk_memory": chunk_memory if self.device.type == "cuda" else "cpu",
        }
        self._tensors: dict[str, Any] = {}

    def _cache(self, device: torch.device | str, num_layers: int) -> PagedKV:
        s = self.model
        return PagedKV.empty(
            s.layout,
            num_layers=num_layers,
            num_blocks=self.num_blocks,
            block_size=s.block_size,
            num_heads=s.num_kv_heads,
            head_size=s.head_size,
            dtype=s.dtype,
            device=device,
        )

    @staticmethod
    def _word_bytes(paged: PagedKV, chunk: torch.Tensor) -> int:
        from kvtier_kernels import paged_copy

        layers = range(paged.num_layers)
        table = paged_copy._layer_table(paged, layers)
        return paged_copy._word_view(paged, chunk, table.alignment)[2]

    def setup(self) -> None:
        from kvtier_kernels import registry

        s, device = self.model, self.device
        gen = torch.Generator().manual_seed(self.seed)
        paged = self._cache(device, s.num_layers)
        for t in paged.tensors:
            _fill_random_bits_(t, gen)
        blocks = torch.randperm(self.num_blocks, generator=gen)[: -(-s.chunk_size // s.block_size)]
        slots = (blocks[:, None] * s.block_size + torch.arange(s.block_size)).flatten()
        slots = slots[: s.chunk_size].to(device)
        padded = slots.clone()
        padded[::7] = -1
        chunk_shape = paged.chunk_shape(s.chunk_size)
        chunk = _alloc_chunk(chunk_shape, s.dtype, device, self.chunk_memory)
        start = torch.empty(chunk_shape, dtype=s.dtype)
        _fill_random_bits_(start, gen)
        chunk.copy_(start)
        if self._word_bytes(paged, chunk) != self.word_bytes:
            raise RuntimeError(f"{self.describe()}: word size differs from the replica's")
        t = self._tensors = {
            "paged": paged,
            "slots": {"full": slots, "padded": padded},
            "chunk": chunk,
            "start": start.to(chunk.device),
            "impl": self._impl or registry.get(self.op, self.backend, device),
        }
        from kvtier_kernels.paged_copy import gather_reference, scatter_reference

        if self.op == "paged_gather":
            t["expected"] = {}
            for name, mapping in t["slots"].items():
                expected = t["start"].clone()
                gather_reference(paged, mapping, expected)
                t["expected"][name] = expected
        else:
            t["initial"] = [x.clone() for x in paged.tensors]
            t["expected"] = {}
            for name, mapping in t["slots"].items():
                expected = PagedKV(paged.layout, [x.clone() for x in paged.tensors])
                scatter_reference(expected, mapping, chunk)
                t["expected"][name] = expected.tensors
        _sync(device)

    def run(self, config: Any) -> None:
        t = self._tensors
        t["impl"](t["paged"], t["slots"]["full"], t["chunk"], config=config)

    def check(self, config: Any) -> str | None:
        t = self._tensors
        paged, chunk = t["paged"], t["chunk"]
        for name, mapping in t["slots"].items():
            if self.op == "paged_gather":
                chunk.copy_(t["start"])
                _sync(self.device)
                t["impl"](paged, mapping, chunk, config=config)
                _sync(self.device)
                problem = _first_difference(chunk, t["expected"][name], "plane layer token col")
            else:
                for x, x0 in zip(paged.tensors, t["initial"], strict=True):
                    x.copy_(x0)
                _sync(self.device)
                t["impl"](paged, mapping, chunk, config=config)
                _sync(self.device)
                problem = None
                for layer, (x, want) in enumerate(
                    zip(paged.tensors, t["expected"][name], strict=True)
                ):
                    problem = _first_difference(x, want, " ".join(paged.layout.axes))
                    if problem:
                        problem = f"layer {layer}: {problem}"
                        break
            if problem:
                return f"{name} slot mapping: {problem}"
        return None

    def teardown(self) -> None:
        self._tensors = {}


# Re-rotation tolerance: |got - want| <= _ROPE_ATOL + _ROPE_RTOL * |want| in fp32, and one
# ulp of the storage dtype more for fp16 / bf16 (a last-bit cos/sin or an FMA may flip one
# rounding; the interpreter truncates fp32 -> bf16). Dims past rotary_dim: bit-exact.
_ROPE_ATOL = 1e-5
_ROPE_RTOL = 1e-5
_MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


class RopeProblem(TuningProblem):
    """``rope_rerotate`` of one chunk's K plane ``[L, T, H * D]`` (NeoX pairing), random
    keys and positions below 4096; each candidate is checked against the torch reference
    within the tolerance above."""

    def __init__(
        self,
        shape: ModelShape,
        device: torch.device,
        backend: str,
        *,
        quick: bool = False,
        seed: int = 0,
        impl: Callable[..., Any] | None = None,
    ) -> None:
        from kvtier_kernels import rope

        if shape.dtype not in rope.SUPPORTED_DTYPES:
            raise ValueError(f"rope_rerotate does not support {shape.dtype}")
        if shape.rope_dim == 0:
            raise ValueError("the model has no rotary dims to re-rotate")
        self.op, self.model, self.device, self.backend, self.seed = (
            "rope_rerotate",
            shape,
            torch.device(device),
            backend,
            seed,
        )
        self.dtype, self._impl = shape.dtype, impl
        half = shape.rope_dim // 2
        self.key = {"half_rotary": half, "num_tokens": shape.chunk_size}
        self.heuristic = rope.launch_config(
            half, shape.chunk_size, shape.dtype, self.device, tuned=False
        )
        self.candidates = _with_heuristic(
            rope_candidates(half, shape.chunk_size, quick=quick), self.heuristic
        )
        itemsize = shape.dtype.itemsize
        self.bytes_moved = (
            2 * shape.num_layers * shape.chunk_size * shape.num_kv_heads * shape.rope_dim * itemsize
        )
        self.shape = {
            "num_layers": shape.num_layers,
            "num_tokens": shape.chunk_size,
            "num_kv_heads": shape.num_kv_heads,
            "head_size": shape.head_size,
            "rotary_dim": shape.rope_dim,
            "is_neox_style": True,
        }
        self._tensors: dict[str, Any] = {}

    def setup(self) -> None:
        from kvtier_kernels import registry
        from kvtier_kernels.rope import rerotate_reference

        s, device = self.model, self.device
        gen = torch.Generator().manual_seed(self.seed)
        width = s.num_kv_heads * s.head_size
        chunk = torch.randn(2, s.num_layers, s.chunk_size, width, generator=gen).to(s.dtype)
        chunk = chunk.to(device)
        k = chunk[0]  # the K plane of a KV_2LTD chunk
        old = torch.randint(0, 4096, (s.chunk_size,), generator=gen).to(device)
        new = torch.randint(0, 4096, (s.chunk_size,), generator=gen).to(device)
        geometry = {"head_size": s.head_size, "rotary_dim": s.rope_dim, "is_neox_style": True}
        initial = k.clone()
        expected = rerotate_reference(initial.clone(), old, new, **geometry)
        self._tensors = {
            "chunk": chunk,
            "k": k,
            "old": old,
            "new": new,
            "geometry": geometry,
            "initial": initial,
            "expected": expected,
            "impl": self._impl or registry.get(self.op, self.backend, device),
        }
        _sync(device)

    def run(self, config: Any) -> None:
        t = self._tensors
        t["impl"](t["k"], t["old"], t["new"], **t["geometry"], config=config)

    def check(self, config: Any) -> str | None:
        t = self._tensors
        k = t["k"]
        k.copy_(t["initial"])
        _sync(self.device)
        self.run(config)
        _sync(self.device)
        s = self.model
        heads = (s.num_layers, s.chunk_size, s.num_kv_heads, s.head_size)
        got, want = k.cpu().view(heads), t["expected"].cpu().view(heads)
        rest = _first_difference(
            got[..., s.rope_dim :], want[..., s.rope_dim :], "layer token head dim"
        )
        if rest:
            return f"dims past rotary_dim changed: {rest}"
        got64, want64 = got[..., : s.rope_dim].double(), want[..., : s.rope_dim].double()
        tolerance = _ROPE_ATOL + _ROPE_RTOL * want64.abs()
        if k.dtype != torch.float32:
            _, exponent = torch.frexp(want64.abs())
            tolerance = tolerance + torch.ldexp(
                torch.ones_like(want64), exponent - 1 - _MANTISSA_BITS[k.dtype]
            )
        bad = (got64 - want64).abs() > tolerance
        if bool(bad.any()):
            layer, token, head, dim = (int(i) for i in bad.nonzero()[0])
            return (
                f"{int(bad.sum())} values off the torch reference beyond tolerance; first at "
                f"layer {layer}, token {token}, head {head}, dim {dim}: got "
                f"{float(got64[layer, token, head, dim])!r}, want {float(want64[layer, token, head, dim])!r}"
            )
        return None

    def teardown(self) -> None:
        self._tensors = {}


def build_problems(
    shape: ModelShape,
    *,
    device: torch.device | str,
    backend: str,
    ops: Sequence[str] = tuple(TUNABLES),
    chunk_memory: str = "pinned",
    quick: bool = False,
) -> tuple[list[TuningProblem], list[str]]:
    """The problems :func:`tune` runs for ``shape``, and notes on ops it skips (RoPE for
    fp8 caches or models without RoPE). Nothing is allocated on ``device`` yet.

    Raises:
        ValueError: an op that is not tunable.
    """
    device = torch.device(device)
    problems: list[TuningProblem] = []
    notes: list[str] = []
    for op in ops:
        if op not in TUNABLES:
            raise ValueError(f"op {op!r} is not tunable; tunable ops: {', '.join(TUNABLES)}")
        if op == "rope_rerotate":
            from kvtier_kernels.rope import SUPPORTED_DTYPES

            if shape.rope_dim == 0:
                notes.append("rope_rerotate skipped: the model has no rotary dims to re-rotate")
            elif shape.dtype not in SUPPORTED_DTYPES:
                notes.append(
                    f"rope_rerotate skipped: it does not support {dtype_name(shape.dtype)} keys"
                )
            else:
                problems.append(RopeProblem(shape, device, backend, quick=quick))
        else:
            problems.append(
                PagedCopyProblem(op, shape, device, backend, chunk_memory=chunk_memory, quick=quick)
            )
    return problems, notes


# ---------------------------------------------------------------------------------------
# timing and the sweep
# ---------------------------------------------------------------------------------------

Timer = Callable[[Callable[[], None], int, int], list[float]]
"""``timer(fn, warmup, repeats)``: call ``fn`` ``warmup`` times untimed, then return the
seconds of each of ``repeats`` timed calls."""

Progress = Callable[[str], None]


def event_timer(device: torch.device | str, *, flush_bytes: int = 256 << 20) -> Timer:
    """A :data:`Timer` for a CUDA/ROCm ``device``: CUDA/HIP events around each call on the
    current stream, with the L2 cache flushed (``flush_bytes`` zeroed) before each."""
    device = torch.device(device)
    flush = torch.empty(flush_bytes, dtype=torch.int8, device=device)

    def timer(fn: Callable[[], None], warmup: int, repeats: int) -> list[float]:
        with torch.cuda.device(device):
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize(device)
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(repeats)
            ]
            for start, end in events:
                flush.zero_()  # also keeps the GPU busy while the launch is enqueued
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(device)
            return [start.elapsed_time(end) * 1e-3 for start, end in events]

    return timer


def _describe_config(config: Any) -> str:
    return " ".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config))


@dataclass(slots=True)
class ProblemResult:
    """What :func:`tune_problem` found for one problem.

    Attributes:
        problem: the problem.
        timed: ``(config, median seconds)`` of every candidate that passed the check.
        rejected: ``(config, reason)`` of every candidate that did not (or did not run).
        best: the fastest checked config, or None when every candidate was rejected.
        best_s / heuristic_s: their median seconds (None when not timed).
    """

    problem: TuningProblem
    timed: list[tuple[Any, float]]
    rejected: list[tuple[Any, str]]
    best: Any | None
    best_s: float | None
    heuristic_s: float | None

    def entry(self) -> TuningEntry | None:
        """The tuning-file entry for the best config (None if there is none)."""
        if self.best is None or self.best_s is None:
            return None
        p = self.problem
        return TuningEntry(
            key=dict(p.key),
            config=dataclasses.asdict(self.best),
            median_us=round(self.best_s * 1e6, 3),
            gbps=round(p.bytes_moved / self.best_s / 1e9, 3) if self.best_s > 0 else None,
            heuristic_us=None if self.heuristic_s is None else round(self.heuristic_s * 1e6, 3),
            candidates=len(self.timed),
            rejected=len(self.rejected),
            shape=dict(p.shape),
        )


def tune_problem(
    problem: TuningProblem,
    *,
    timer: Timer,
    warmup: int = 5,
    repeats: int = 25,
    progress: Progress | None = None,
    counter: tuple[int, int] = (0, 0),
) -> ProblemResult:
    """Check every candidate of ``problem`` against the reference, time the ones that
    pass with ``timer`` (median of ``repeats``), and pick the fastest.

    A candidate that raises (fails to compile or launch) is rejected like one that gives a
    wrong result. ``counter`` is (candidates done before this problem, total) for
    progress lines.
    """
    say = progress or (lambda _message: None)
    done, total = counter
    total = total or len(problem.candidates)
    width = len(str(total))
    timed: list[tuple[Any, float]] = []
    rejected: list[tuple[Any, str]] = []
    heuristic_s = None
    problem.setup()
    try:
        for i, config in enumerate(problem.candidates, start=done + 1):
            label = f"[{i:>{width}}/{total}] {problem.describe()}: {_describe_config(config)}"
            try:
                reason = problem.check(config)
                if reason is None:
                    times = timer(functools.partial(problem.run, config), warmup, repeats)
            except Exception as error:  # a config that cannot compile or launch
                reason = f"failed to run: {type(error).__name__}: {error}".splitlines()[0]
            if reason is not None:
                rejected.append((config, reason))
                say(f"{label}  REJECTED ({reason})")
                continue
            median = statistics.median(times)
            timed.append((config, median))
            if config == problem.heuristic:
                heuristic_s = median
            rate = f"  {problem.bytes_moved / median / 1e9:8.1f} GB/s" if median > 0 else ""
            mark = "  (heuristic)" if config == problem.heuristic else ""
            say(f"{label}  {median * 1e6:10.2f} us{rate}{mark}")
    finally:
        problem.teardown()
    for config, reason in rejected:
        if config == problem.heuristic:
            say(f"WARNING: {problem.describe()}: the built-in heuristic's config failed: {reason}")
    best, best_s = min(timed, key=lambda item: item[1]) if timed else (None, None)
    return ProblemResult(problem, timed, rejected, best, best_s, heuristic_s)


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for dist in ("triton", "kvtier"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    if torch.version.hip:
        versions["hip"] = torch.version.hip
    return versions


def run_problems(
    problems: Sequence[TuningProblem],
    *,
    device: torch.device | str,
    backend: str,
    timer: Timer,
    warmup: int = 5,
    repeats: int = 25,
    progress: Progress | None = None,
) -> tuple[list[ProblemResult], list[TuningFile]]:
    """Run :func:`tune_problem` on each problem, one at a time, and group the entries
    into tuning files (one per op and dtype) for ``device``."""
    device = torch.device(device)
    name = device_name(device)
    if name is None:
        raise ValueError(f"cannot name device {device} for tuning files")
    total = sum(len(p.candidates) for p in problems)
    results, files, done = [], {}, 0
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for problem in problems:
        result = tune_problem(
            problem,
            timer=timer,
            warmup=warmup,
            repeats=repeats,
            progress=progress,
            counter=(done, total),
        )
        done += len(problem.candidates)
        results.append(result)
        entry = result.entry()
        if entry is None:
            continue
        file_key = (problem.op, dtype_name(problem.dtype))
        if file_key not in files:
            files[file_key] = TuningFile(
                op=problem.op,
                backend=backend,
                device=name,
                dtype=dtype_name(problem.dtype),
                entries=[],
                versions=_versions(),
                created=created,
            )
        files[file_key].entries.append(entry)
    return results, list(files.values())


# ---------------------------------------------------------------------------------------
# copy engine against the kernel
# ---------------------------------------------------------------------------------------


def find_crossover(points: Sequence[Mapping[str, float]]) -> int | None:
    """The smallest ``bytes`` from which on ``copy_us < kernel_us`` at every point
    (``points`` in any order), or None when the kernel wins at the largest size."""
    ordered = sorted(points, key=lambda p: p["bytes"])
    crossover = None
    for point in reversed(ordered):
        if point["copy_us"] < point["kernel_us"]:
            crossover = int(point["bytes"])
        else:
            break
    return crossover


def _pages_layout(layout: str) -> str:
    """``layout`` if one layer's blocks are contiguous runs in memory, else ``vllm_nhd``."""
    kv_layout = get_layout(layout)
    storage = (kv_layout.storage or kv_layout.dims).split()
    return layout if storage[0] == "NB" and not kv_layout.cross_layer else "vllm_nhd"


def measure_copy_engine(
    shape: ModelShape,
    *,
    device: torch.device | str,
    backend: str,
    timer: Timer,
    warmup: int = 5,
    repeats: int = 25,
    max_bytes: int = 64 << 20,
    progress: Progress | None = None,
) -> dict[str, CopyEngineFigures]:
    """Time, per size of a contiguous run of pages of one layer (1, 2, 4, ... blocks up to
    ``max_bytes``), the kernel (with the launch parameters in effect) against one
    ``copy_(non_blocking=True)`` of the same bytes, both ways between the device and
    pinned host memory; return the figures per op (``paged_gather``: device to host,
    ``paged_scatter``: host to device).

    The cache uses ``shape.layout`` when its blocks are contiguous runs (NB outermost in
    memory), else ``vllm_nhd``.
    """
    from kvtier_kernels import registry

    say = progress or (lambda _message: None)
    device = torch.device(device)
    layout = _pages_layout(shape.layout)
    kv = get_layout(layout).kv_planes
    s = shape
    block_elems = kv * s.block_size * s.num_kv_heads * s.head_size
    block_bytes = block_elems * s.dtype.itemsize
    max_blocks = 1 << max(0, (max(1, max_bytes // block_bytes)).bit_length() - 1)
    paged = PagedKV.empty(
        layout,
        num_layers=1,
        num_blocks=max_blocks,
        block_size=s.block_size,
        num_heads=s.num_kv_heads,
        head_size=s.head_size,
        dtype=s.dtype,
        device=device,
    )
    _fill_random_bits_(paged.tensors[0], torch.Generator().manual_seed(1))
    layer = paged.tensors[0]
    pinned = device.type == "cuda"
    host_pages = torch.empty(max_blocks * block_elems, dtype=s.dtype, pin_memory=pinned)
    host_chunk = torch.empty(max_blocks * block_elems, dtype=s.dtype, pin_memory=pinned)
    base = layer.storage_offset()
    if layer.stride(get_layout(layout).axes.index("NB")) != block_elems:
        raise AssertionError(f"layout {layout}: blocks are not contiguous runs of {block_elems}")
    figures = {}
    for op, direction in (("paged_gather", "device_to_host"), ("paged_scatter", "host_to_device")):
        impl = registry.get(op, backend, device)
        points = []
        blocks = 1
        while blocks <= max_blocks:
            tokens = blocks * s.block_size
            slots = torch.arange(tokens, device=device)
            chunk = host_chunk[: kv * tokens * s.num_kv_heads * s.head_size].view(
                paged.chunk_shape(tokens)
            )
            pages = layer.as_strided((blocks * block_elems,), (1,), base)  # blocks [0, blocks)
            host = host_pages[: blocks * block_elems]
            source, target = (pages, host) if op == "paged_gather" else (host, pages)

            def kernel(slots=slots, chunk=chunk, impl=impl) -> None:
                impl(paged, slots, chunk)

            def copy(source=source, target=target) -> None:
                target.copy_(source, non_blocking=True)

            kernel_s = statistics.median(timer(kernel, warmup, repeats))
            copy_s = statistics.median(timer(copy, warmup, repeats))
            nbytes = blocks * block_bytes
            points.append(
                {
                    "bytes": nbytes,
                    "kernel_us": round(kernel_s * 1e6, 3),
                    "copy_us": round(copy_s * 1e6, 3),
                }
            )
            say(
                f"copy engine {direction}: {_format_bytes(nbytes):>10}  kernel "
                f"{kernel_s * 1e6:9.2f} us  copy_ {copy_s * 1e6:9.2f} us"
            )
            blocks *= 2
        figures[op] = CopyEngineFigures(
            direction=direction,
            crossover_bytes=find_crossover(points),
            points=points,
            shape={
                "layout": layout,
                "block_bytes": block_bytes,
                "block_size": s.block_size,
                "num_kv_heads": s.num_kv_heads,
                "head_size": s.head_size,
                "cache_dtype": dtype_name(s.dtype),
            },
        )
    _sync(device)
    return figures


# ---------------------------------------------------------------------------------------
# the whole pipeline
# ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class TuneReport:
    """What :func:`tune` did.

    Attributes:
        results: one per problem run.
        files: the tuning files produced (with copy-engine figures when measured).
        written: the paths written (empty when no directory was given).
        copy_engine: the copy-engine figures per op, when measured.
        notes: ops skipped and why.
    """

    results: list[ProblemResult]
    files: list[TuningFile]
    written: list[Path]
    copy_engine: dict[str, CopyEngineFigures]
    notes: list[str]


def tune(
    shape: ModelShape,
    *,
    device: torch.device | str,
    backend: str,
    timer: Timer,
    out_dir: str | Path | None,
    ops: Sequence[str] = tuple(TUNABLES),
    chunk_memory: str = "pinned",
    quick: bool = False,
    warmup: int = 5,
    repeats: int = 25,
    copy_engine: bool = True,
    copy_engine_max_bytes: int = 64 << 20,
    progress: Progress | None = None,
    problems: Sequence[TuningProblem] | None = None,
) -> TuneReport:
    """Sweep, check, time and write tuning files for ``shape`` on ``device``.

    Steps: build the problems (or take ``problems``), run them (:func:`run_problems`),
    write the files into ``out_dir`` (merged with what is there), then, when
    ``copy_engine`` and a paged copy was tuned, measure the copy-engine crossover with the
    new configs in effect and write it into the paged-copy files. ``out_dir=None`` writes
    nothing (and measures the crossover with the configs in effect before).

    ``kvtier tune`` calls this with the GPU, ``backend="triton"`` and :func:`event_timer`;
    tests call it with the CPU, ``"interpret"`` and a fake timer.
    """
    device = torch.device(device)
    notes: list[str] = []
    if problems is None:
        problems, notes = build_problems(
            shape, device=device, backend=backend, ops=ops, chunk_memory=chunk_memory, quick=quick
        )
    results, files = run_problems(
        problems,
        device=device,
        backend=backend,
        timer=timer,
        warmup=warmup,
        repeats=repeats,
        progress=progress,
    )
    written = [save_tuning_file(f, out_dir) for f in files] if out_dir is not None else []
    figures: dict[str, CopyEngineFigures] = {}
    paged_files = [f for f in files if f.op in ("paged_gather", "paged_scatter")]
    if copy_engine and paged_files:
        # NOTE: the output directory may not be on the search path: put it first while
        # measuring, so that the kernel runs with the configs just tuned.
        saved = _override
        if out_dir is not None:
            set_search_path((Path(out_dir), *search_path()))
        try:
            figures = measure_copy_engine(
                shape,
                device=device,
                backend=backend,
                timer=timer,
                warmup=warmup,
                repeats=repeats,
                max_bytes=copy_engine_max_bytes,
                progress=progress,
            )
        finally:
            set_search_path(saved)
        for f in paged_files:
            f.copy_engine = figures.get(f.op)
        if out_dir is not None:
            written = [save_tuning_file(f, out_dir) for f in files]
    return TuneReport(results, files, written, figures, notes)
