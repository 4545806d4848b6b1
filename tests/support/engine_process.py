"""A real vLLM engine (CPU build) in a process of its own (``tests/support/vllm_node_engine.py``),
driven over JSON lines: the engines of the node-server and disaggregated-prefill tests.

    engine = EngineProcess(model, "engine-a", {"remote_url": url}, log, kv_role="kv_both")
    engine.wait_ready()
    results, seconds = engine.generate(prompts)      # [(output ids, cached tokens)], s
    engine.call("stats")                             # the kvtier worker's counters
    engine.close()
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

ENGINE_SCRIPT = Path(__file__).resolve().parent / "vllm_node_engine.py"
STARTUP_S = 600  # two engines starting at once on a 2-core machine


class EngineProcess:
    """``vllm_node_engine.py`` as a child process: ``call(op, ...)`` sends one command and
    returns its reply; stderr goes to a log file."""

    def __init__(
        self,
        model: Path,
        engine_id: str,
        extra: dict,
        log: Path,
        *,
        kv_role: str = "kv_both",
        in_process: bool = False,
    ):
        self.engine_id = engine_id
        self._log = log
        env = os.environ.copy()
        if in_process:  # the worker in the engine's process: ``chunk_names`` works
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        args = [str(model), engine_id, json.dumps(extra), kv_role]
        with open(log, "ab") as err:
            self.process = subprocess.Popen(
                [sys.executable, str(ENGINE_SCRIPT), *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"engine {self.engine_id} did not answer in {timeout} s") from None
        if line is None:
            tail = self._log.read_text()[-3000:]
            raise AssertionError(f"engine {self.engine_id} exited:\n{tail}")
        return json.loads(line)

    def wait_ready(self, timeout: float = STARTUP_S) -> None:
        assert self._reply(timeout) == {"ready": True}

    def send(self, op: str, **fields) -> None:
        """Send one command without waiting for its reply (see ``reply_to_generate``)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()

    def call(self, op: str, timeout: float = 300, **fields) -> dict:
        self.send(op, **fields)
        return self._reply(timeout)

    def generate(
        self, prompts, timeout: float = 300, *, max_tokens: int = 8, finish: bool = False
    ) -> tuple[list, float]:
        """Greedy outputs ``[(output ids, cached tokens)]`` (with ``finish``: and each
        request's finish reason) and the wall time of the batch."""
        self.send("generate", prompts=prompts, max_tokens=max_tokens)
        return self.reply_to_generate(timeout, finish=finish)

    def reply_to_generate(self, timeout: float = 300, *, finish: bool = False):
        """The reply to a ``generate`` sent with ``send``, as ``generate`` returns it."""
        reply = self._reply(timeout)
        results = [
            (tuple(ids), cached, reason) if finish else (tuple(ids), cached)
            for ids, cached, reason in reply["results"]
        ]
        return results, reply["seconds"]

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.send("quit")  # no reply: the engine shuts down and the process exits
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
