"""The soak's fault injectors and process probes (``perf/soak/soak.py``).

- ``FaultyProxy``: a TCP proxy between an engine and its remote (redis-server or
  ``kvtier serve``) that can be made slow (every forwarded chunk delayed) or dropping
  (live connections cut, new ones closed on accept) for a while.
- ``corrupt_files``: chunk files of the disk tier truncated, bit-flipped or deleted under
  the running engine.
- ``SmallDisk``: the disk tier's directory on a small tmpfs, filled by a ballast file to
  make the disk full (ENOSPC); ``None`` where tmpfs cannot be mounted.
- ``tree_usage``: RSS and open descriptors of a process and its children.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import socket
import subprocess
import threading
import time
from pathlib import Path

import psutil


class FaultyProxy:
    """Forwards 127.0.0.1:``port`` to ``target`` (host, port); ``mode`` is ``"ok"``,
    ``"slow"`` (each chunk held ``delay_s``) or ``"drop"`` (connections cut)."""

    def __init__(self, target: tuple[str, int], delay_s: float):
        self.target = target
        self.delay_s = delay_s
        self.mode = "ok"
        self.cut = 0  # connections cut while dropping
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        if mode == "drop":
            with self._lock:
                live, self._live = self._live, set()
            for sock in live:
                self._close(sock)
                self.cut += 1

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.mode == "drop":
                self._close(client)
                self.cut += 1
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:  # the remote is down: so is the path
                self._close(client)
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._live |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while True:
                readable, _, _ = select.select([a, b], [], [], 1.0)
                for sock in readable:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    if self.mode == "slow":
                        time.sleep(self.delay_s)
                    peers[sock].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                self._live -= {a, b}
            self._close(a)
            self._close(b)

    @staticmethod
    def _close(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()

    def close(self) -> None:
        self._closed = True
        self._close(self._listener)
        self.set_mode("drop")


def chunk_files(root: Path) -> list[Path]:
    """The disk tier's chunk files, oldest first (the ones least likely in memory)."""
    files = []
    for path in root.rglob("*.kvt"):
        with contextlib.suppress(OSError):
            files.append((path.stat().st_mtime, path))
    return [path for _, path in sorted(files)]


def corrupt_files(root: Path, how: str, count: int, rng: random.Random) -> int:
    """Truncate, bit-flip or delete ``count`` of the oldest chunk files; how many were."""
    done = 0
    for path in chunk_files(root)[:count]:
        try:
            if how == "delete":
                path.unlink()
            elif how == "truncate":
                size = path.stat().st_size
                os.truncate(path, rng.randrange(0, max(1, size)))
            else:  # one bit of the payload (or header) flipped in place
                with open(path, "r+b") as f:
                    size = f.seek(0, os.SEEK_END)
                    at = rng.randrange(size)
                    f.seek(at)
                    byte = f.read(1)[0]
                    f.seek(at)
                    f.write(bytes([byte ^ (1 << rng.randrange(8))]))
            done += 1
        except (OSError, IndexError):
            continue  # evicted meanwhile
    return done


def dir_bytes(root: Path) -> int:
    """Bytes of the chunk files under ``root`` (what counts against the disk cap)."""
    total = 0
    for path in root.rglob("*.kvt"):
        with contextlib.suppress(OSError):
            total += path.stat().st_size
    return total


class SmallDisk:
    """A tmpfs of ``size_bytes`` at ``path``; ``fill()`` leaves it full, ``drain()``
    frees it again. ``mount`` returns None where mounting is not allowed."""

    def __init__(self, path: Path):
        self.path = path
        self.ballast = path / "ballast"

    @classmethod
    def mount(cls, path: Path, size_bytes: int) -> SmallDisk | None:
        path.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                capture_output=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError):  # no mount(8)
            return None
        return cls(path) if done.returncode == 0 else None

    def fill(self) -> None:
        """Take whatever space is free (appended to the ballast: the space it holds is
        never given back meanwhile); a filesystem too full to open it is full already."""
        with contextlib.suppress(OSError), open(self.ballast, "ab") as f:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()

    def drain(self) -> None:
        with contextlib.suppress(OSError):
            self.ballast.unlink()

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


def process_tree(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    return []


def tree_usage(pid: int) -> tuple[tuple[int, int], int]:
    """((RSS bytes of ``pid`` and its children, of ``pid`` alone), open descriptors of
    them all)."""
    rss = fds = root = 0
    for proc in process_tree(pid):
        with contextlib.suppress(psutil.Error):
            rss += proc.memory_info().rss
            fds += proc.num_fds()
            root = root or rss
    return (rss, root), fds


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it, children first collected."""
    procs = process_tree(pid)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)


def slope_per_hour(times: list[float], values: list[float]) -> float:
    """Least-squares slope of ``values`` over ``times`` (seconds), per hour (0 under 3
    samples)."""
    return pooled_slope_per_hour([(times, values)]) if len(times) >= 3 else 0.0


def pooled_slope_per_hour(lives: list[tuple[list[float], list[float]]]) -> float:
    """One least-squares slope, per hour, over several process lives at once: each life
    keeps its own level (a restarted process starts from its own baseline) and all share
    one slope, so a leak shows however the run is cut into lives."""
    num = var = 0.0
    for times, values in lives:
        n = len(times)
        if n < 2:
            continue
        mt, mv = sum(times) / n, sum(values) / n
        var += sum((t - mt) ** 2 for t in times)
        num += sum((t - mt) * (v - mv) for t, v in zip(times, values, strict=True))
    return num / var * 3600 if var else 0.0
