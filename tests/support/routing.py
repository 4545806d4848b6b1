"""Cache-aware routing with real engines: ``kv_both`` vLLM OpenAI servers (CPU build) that
publish KV events, each with its own kvtier CPU tier, behind ``kvtier proxy``.

    instances = [RoutedInstance(model, logs / f"{i}.log", extra) for i in range(2)]
    for instance in instances:
        instance.server.wait_healthy()
    proxy = ProxyProcess(cache_aware_flags(instances), logs / "proxy.log")
    post_json(proxy.url + "/v1/chat/completions", chat(model, system, question))
    proxy.metrics("kvtier_proxy_route_decisions_total", "instance")  # {url: count}
    proxy.restart()                  # the same port and flags again
    proxy.close(); [i.server.close() for i in instances]

Every engine hashes its blocks with ``--prefix-caching-hash-algo sha256_cbor`` (vLLM's
default, ``sha256``, hashes a pickle: nothing outside vLLM reproduces it) and runs with
``PYTHONHASHSEED=HASH_SEED``, kvtier's ``hash_seed`` set to the same: without a shared
seed no two processes compute the same block hashes, and no router can match a request
to what an engine holds (docs/hashing.md). Each engine binds its KV
event publisher (vLLM's ZMQ PUB) and its replay socket (ROUTER) on free ports.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

from support.engines import kv_transfer_config, prompts_of
from support.redis_server import free_port
from support.vllm_openai import VllmServer, http

HASH_SEED = "31"  # every engine's PYTHONHASHSEED, and the proxy's --hash-seed
PROXY_STARTUP_S = 60
# Plain words of the test tokenizer (support.models.add_word_tokenizer: ids 0-5 are
# special tokens and role names).
FIRST_WORD = 6


def word_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Random token ids of plain words (no special tokens, no role names)."""
    return [[FIRST_WORD + t for t in p] for p in prompts_of(lengths, seed=seed, vocab=500)]


def words(token_ids: list[int]) -> str:
    """The text the word tokenizer turns into exactly ``token_ids``."""
    return " ".join(f"w{t}" for t in token_ids)


def chat(model: str, system: str, question: str, max_tokens: int = 2, **more) -> dict:
    """A greedy chat request: a system prompt and a user question (the word tokenizer's
    chat template makes it ``system <system> user <question> assistant``)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return body | {"ignore_eos": True} | more


def shared_prefix_workload(
    prompts: int, questions: int, *, system_words: int, question_words: int, seed: int
) -> list[tuple[int, str, str]]:
    """``prompts`` system prompts, each followed by ``questions`` questions (every one
    different), as ``(prompt index, system, question)`` shuffled with ``seed``. A request's
    templated tokens share ``system_words + 2`` tokens with the other requests of its
    system prompt (``system``, the words, ``user``)."""
    systems = [words(p) for p in word_prompts([system_words] * prompts, seed=seed)]
    asked = word_prompts([question_words] * (prompts * questions), seed=seed + 1)
    requests = [
        (i, systems[i], words(asked[i * questions + q]))
        for i in range(prompts)
        for q in range(questions)
    ]
    random.Random(seed).shuffle(requests)
    return requests


class RoutedInstance:
    """A ``kv_both`` vLLM OpenAI server with kvtier, KV events on, and
    ``--enable-prompt-tokens-details`` (answers carry ``cached_tokens``).

    Args:
        model: a local model directory with a tokenizer (``support.models.add_word_tokenizer``).
        log: the server's output.
        extra: kvtier's config (``hash_seed`` is set to ``HASH_SEED``).
        block_size: vLLM's block size.
        kv_cache_memory_bytes: the size of vLLM's own KV cache (its prefix cache).
        env: more environment variables for the server.
    """

    def __init__(
        self,
        model: Path,
        log: Path,
        extra: dict,
        *,
        block_size: int = 32,
        kv_cache_memory_bytes: int = 128 << 20,
        env: dict[str, str] | None = None,
    ):
        self.engine_id = f"kvtier-routing-{uuid.uuid4().hex[:8]}"
        self.events_port, self.replay_port = free_port(), free_port()
        # NOTE: vLLM's publisher binds a wildcard endpoint and connects to any other one.
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
        }
        self.server = VllmServer(
            model,
            log,
            kv_transfer=kv_transfer_config(
                {**extra, "hash_seed": HASH_SEED}, engine_id=self.engine_id
            ),
            tokenizer=True,
            block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            args=[
                "--kv-events-config",
                json.dumps(kv_events),
                "--prefix-caching-hash-algo",
                "sha256_cbor",
                "--enable-prompt-tokens-details",
            ],
            env={"PYTHONHASHSEED": HASH_SEED, **(env or {})},
        )

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


def cache_aware_flags(instances: list[RoutedInstance], *more: str) -> list[str]:
    """``kvtier proxy`` flags: every instance as a ``--decode`` instance with its event
    stream and replay socket, ``--policy cache_aware`` and the engines' hash seed."""
    flags = ["--policy", "cache_aware", "--hash-seed", HASH_SEED, *more]
    for instance in instances:
        flags += ["--decode", instance.url]
        flags += [
            "--kv-events",
            f"{instance.url}={instance.events_endpoint};replay={instance.replay_endpoint}",
        ]
    return flags


def samples(text: str, name: str, label: str) -> dict[str, float]:
    """A Prometheus metric's samples by the value of one label (summed over the others)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        labels, value = line[len(name) + 1 :].rsplit("} ", 1)
        for pair in labels.split(","):
            key, _, quoted = pair.partition("=")
            if key.strip() == label:
                found[quoted.strip('"')] = found.get(quoted.strip('"'), 0.0) + float(value)
    return found


class ProxyProcess:
    """``kvtier proxy FLAGS`` on a free loopback port (the same port on ``restart``)."""

    def __init__(self, flags: list[str], log: Path):
        self.flags = flags
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self, timeout: float = PROXY_STARTUP_S) -> None:
        command = [sys.executable, "-m", "kvtier", "proxy", "--port", str(self.port)]
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(
                [*command, *self.flags], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                http(self.url + "/health", timeout=5)
                return
            except OSError:
                if self.process.poll() is not None:
                    raise AssertionError(f"kvtier proxy exited:\n{self.log_tail()}") from None
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"kvtier proxy did not start:\n{self.log_tail()}"
                    ) from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def health(self) -> dict:
        return json.loads(http(self.url + "/health", timeout=10))

    def metrics_text(self) -> str:
        return http(self.url + "/metrics", timeout=10).decode()

    def metrics(self, name: str, label: str) -> dict[str, float]:
        return samples(self.metrics_text(), name, label)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        self.stop()
