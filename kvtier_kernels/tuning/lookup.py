"""Where tuning files are searched for and written, and the lookup every Triton launcher
calls (:func:`tuned_config`). The file format is :mod:`~kvtier_kernels.tuning.files`.

Search path, first match wins (a later file for the same name is shadowed):

1. the directories in ``KVTIER_TUNING_DIR`` (``os.pathsep``-separated), else
   ``$XDG_CACHE_HOME/kvtier/tuning`` (``~/.cache/kvtier/tuning``): what ``kvtier tune``
   writes;
2. ``kvtier_kernels/tuning/tuned/``: defaults shipped with the package, when present.

:func:`set_search_path` replaces both; :func:`prepend_search_path` puts directories in
front of them (kvtier's ``tuning_dir`` config key does this). A file that cannot be read,
is malformed, or is for another op, backend, device or dtype than its name says is
skipped with a warning (once) and the search goes on; nothing here ever raises into a
launcher. This is the one place that reads ``KVTIER_TUNING_DIR``.

Importing this module imports neither triton nor the op modules, and touches no GPU driver.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier_kernels.dtypes import dtype_name
from kvtier_kernels.tuning.files import (
    TuningFile,
    TuningFileError,
    device_name,
    file_name,
    file_prefix,
    load_tuning_file,
)

TUNING_DIR_ENV = "KVTIER_TUNING_DIR"
PACKAGED_DIR = Path(__file__).resolve().parent / "tuned"


# ---------------------------------------------------------------------------------------
# search path and lookup
# ---------------------------------------------------------------------------------------


def _backend_for(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "interpret"


_lock = threading.Lock()
_override: tuple[Path, ...] | None = None
_loaded: dict[tuple[Any, ...], TuningFile | None] = {}


def _tuning_dir_env() -> str | None:
    """``KVTIER_TUNING_DIR`` as set (the code base's one read of it)."""
    return os.environ.get(TUNING_DIR_ENV)


def default_user_dir() -> Path:
    """``$XDG_CACHE_HOME/kvtier/tuning``, or ``~/.cache/kvtier/tuning``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / "tuning"


def _env_dirs() -> tuple[Path, ...]:
    """The directories ``KVTIER_TUNING_DIR`` names (none when unset, empty or only
    separators)."""
    env = _tuning_dir_env() or ""
    return tuple(Path(p).expanduser() for p in env.split(os.pathsep) if p)


def user_dirs() -> tuple[Path, ...]:
    """Where ``kvtier tune`` writes and lookups look first (see the module doc): never
    empty."""
    return _env_dirs() or (default_user_dir(),)


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
        _tuning_dir_env(),
        os.environ.get("XDG_CACHE_HOME"),
        os.environ.get("HOME"),
    )


def search_path_origins() -> list[tuple[Path, str]]:
    """Each directory of :func:`search_path` with where it comes from, as ``kvtier kernels``
    shows it: ``"packaged defaults"``, ``"KVTIER_TUNING_DIR"``, ``"user cache
    (KVTIER_TUNING_DIR unset)"`` or, for one put there by :func:`prepend_search_path` or
    :func:`set_search_path` (kvtier's ``tuning_dir`` key), ``"tuning_dir"``."""
    from_env = bool(_env_dirs())
    defaults = user_dirs()
    rows = []
    for directory in search_path():
        if directory == PACKAGED_DIR:
            origin = "packaged defaults"
        elif directory not in defaults:
            origin = "tuning_dir"
        elif from_env:
            origin = TUNING_DIR_ENV
        else:
            origin = f"user cache ({TUNING_DIR_ENV} unset)"
        rows.append((directory, origin))
    return rows


def set_search_path(directories: Sequence[str | Path] | None) -> None:
    """Search exactly ``directories`` (packaged defaults included only if listed); None
    restores the default (``KVTIER_TUNING_DIR`` or the user cache, then packaged)."""
    global _override
    _override = None if directories is None else tuple(Path(d).expanduser() for d in directories)
    clear_cache()


def prepend_search_path(directories: Sequence[str | Path]) -> None:
    """Search ``directories`` first, then the current search path (a directory already on
    it moves to the front rather than appearing twice). Idempotent; ``set_search_path(None)``
    undoes it."""
    first = tuple(Path(d).expanduser() for d in directories)
    set_search_path(first + tuple(d for d in search_path() if d not in first))


@contextlib.contextmanager
def searching_first(directory: str | Path | None) -> Iterator[None]:
    """Within the ``with`` block, search ``directory`` before the current search path (None:
    leave it as it is); the search path in effect before is restored afterwards."""
    saved = _override
    if directory is not None:
        set_search_path((Path(directory), *search_path()))
    try:
        yield
    finally:
        set_search_path(saved)


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
    try:
        name = device_name(device)  # None for a GPU this machine does not have
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


def copy_engine_crossover(op: str, device: torch.device) -> int | None:
    """The run size (bytes) from which one ``copy_(non_blocking=True)`` of contiguous pages
    beat ``op``'s kernel on ``device`` when ``kvtier tune`` measured it, or None (no file
    with copy-engine figures for this GPU, the kernel always won, or not a GPU). Never
    raises: a problem is a warning and None."""
    if device.type != "cuda":
        return None
    try:
        name = device_name(device)  # None when torch sees no GPU
        if name is None:
            return None
        for dtype in sorted({dtype for _, dtype in _named_files(op, "triton", name)}):
            tuning_file = find_tuning_file(op, "triton", name, dtype)  # the one in effect
            figures = None if tuning_file is None else tuning_file.copy_engine
            if figures is not None and figures.crossover_bytes is not None:
                return figures.crossover_bytes
        return None
    except Exception as error:  # never break a transfer over a tuning file
        warnings.warn(
            f"copy-engine lookup for {op} failed ({error!r}); using the kernel only",
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


def _named_files(op: str, backend: str, device: str) -> list[tuple[Path, str]]:
    """``(path, dtype)`` of every file named for (op, backend, device name) on the search
    path, in search order (a directory's files sorted by name)."""
    prefix = file_prefix(op, backend, device)
    return [
        (path, path.name[len(prefix) : -len(".json")])
        for directory in search_path()
        if directory.is_dir()
        for path in sorted(directory.glob(f"{prefix}*.json"))
    ]


def files_in_effect(op: str, backend: str, device: str) -> list[FileStatus]:
    """Every tuning file of (op, backend, device name) on the search path, any dtype."""
    statuses: list[FileStatus] = []
    in_effect: set[str] = set()
    for path, dtype in _named_files(op, backend, device):
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
                f"; copy engine wins from {format_bytes(crossover)} runs"
                if crossover is not None
                else "; copy engine never won"
            )
        statuses.append(FileStatus(path, dtype, "in effect", detail))
    return statuses


def format_bytes(n: float) -> str:
    """``n`` bytes for people: ``"512 B"``, ``"1.5 KiB"``, ..., ``"2.0 GiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


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
            tuning_file = tuning_file.merged_over(old)
    text = json.dumps(tuning_file.to_json(), indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    clear_cache()  # NOTE: the next lookup must see what was just written
    return path
