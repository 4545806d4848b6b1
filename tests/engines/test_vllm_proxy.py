"""``kvtier proxy`` in front of two real ``vllm serve`` OpenAI servers (CPU build): a
``kv_producer`` for prefill and a ``kv_consumer`` for decode, sharing one ``kvtier serve``.

Completions and chat, streaming and not, go through the proxy. The decode instance loads
the prompt's KV that the prefill instance stored (vLLM's external prefix cache hits), and
the answer equals the prefill instance's own answer to the same request sent directly
(it computes every token itself: a producer never loads).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from conftest import BLOCK, CHUNK
from support.engines import expected_loaded, kv_transfer_config, prompts_of
from support.kvtier_server import KVTierServerProcess
from support.models import add_word_tokenizer, make_tiny_llama
from support.routing import ProxyProcess
from support.vllm_openai import VllmServer, http, post_json

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

HITS = "vllm:external_prefix_cache_hits_total"


class Deployment:
    def __init__(self, tmp_path_factory):
        model_dir = tmp_path_factory.mktemp("models") / "llama-chat"
        self.model = str(add_word_tokenizer(make_tiny_llama(model_dir)))
        logs = tmp_path_factory.mktemp("proxy-logs")
        self.node = KVTierServerProcess("--chunk-size", str(CHUNK))
        extra = {
            "chunk_size": CHUNK,
            "local_cpu": False,
            "max_local_cpu_size": 0.25,
            "remote_url": self.node.url,
        }
        self.prefill, self.decode = (
            VllmServer(
                model_dir,
                logs / f"{role}.log",
                kv_transfer=kv_transfer_config(extra, kv_role=role),
                tokenizer=True,
                block_size=BLOCK,
            )
            for role in ("kv_producer", "kv_consumer")
        )
        self.proxy: ProxyProcess | None = None
        self.prefill.wait_healthy()
        self.decode.wait_healthy()
        flags = ["--prefill", self.prefill.url, "--decode", self.decode.url]
        self.proxy = ProxyProcess(flags, logs / "proxy.log")
        self.url = self.proxy.url

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.prefill.close()
        self.decode.close()
        self.node.close()


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    pytest.importorskip("vllm")
    deployment = Deployment(tmp_path_factory)
    try:
        yield deployment
    finally:
        deployment.close()


def stream(url: str, body: dict, request_id: str) -> tuple[list[dict], str]:
    """POST a streaming request; its SSE events (``[DONE]`` last) and X-Request-Id."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("X-Request-Id", request_id)
    with urllib.request.urlopen(request, timeout=120) as response:
        raw = response.read().decode()
        echoed = response.headers.get("X-Request-Id")
    data = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", f"the stream did not end with [DONE]: {raw[-300:]}"
    return [json.loads(d) for d in data[:-1]], echoed


def words(token_ids: list[int]) -> str:
    """A text prompt the word tokenizer turns into exactly ``token_ids``."""
    return " ".join(f"w{t}" for t in token_ids)


@pytest.mark.parametrize("streaming", [False, True])
def test_completions_through_the_proxy(pd, streaming):
    (prompt,) = prompts_of([300], seed=31 + streaming, vocab=500)
    prompt = [t + 6 for t in prompt]  # plain words (ids 6..), no special tokens
    body = {"model": pd.model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    body |= {"ignore_eos": True}
    hits = pd.decode.metric(HITS)
    if streaming:
        events, echoed = stream(pd.url + "/v1/completions", {**body, "stream": True}, "cmpl-1")
        assert echoed == "cmpl-1"
        text = "".join(e["choices"][0]["text"] for e in events)
    else:
        text = post_json(pd.url + "/v1/completions", body)["choices"][0]["text"]
    loaded = pd.decode.metric(HITS) - hits
    assert loaded == expected_loaded(len(prompt), chunk_size=CHUNK, block_size=BLOCK, partial=True)
    direct = post_json(pd.prefill.url + "/v1/completions", body)["choices"][0]["text"]
    assert text == direct and text


@pytest.mark.parametrize("streaming", [False, True])
def test_chat_through_the_proxy(pd, streaming):
    (content,) = prompts_of([250], seed=41 + streaming, vocab=500)
    messages = [{"role": "user", "content": words([t + 6 for t in content])}]
    body = {"model": pd.model, "messages": messages, "max_tokens": 8, "temperature": 0}
    body |= {"ignore_eos": True}
    hits = pd.decode.metric(HITS)
    if streaming:
        events, _ = stream(pd.url + "/v1/chat/completions", {**body, "stream": True}, "chat-1")
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    else:
        answer = post_json(pd.url + "/v1/chat/completions", body)
        text = answer["choices"][0]["message"]["content"]
    loaded = pd.decode.metric(HITS) - hits
    direct = post_json(pd.prefill.url + "/v1/chat/completions", body)
    assert text == direct["choices"][0]["message"]["content"] and text
    num_tokens = direct["usage"]["prompt_tokens"]  # the templated prompt
    assert loaded == expected_loaded(num_tokens, chunk_size=CHUNK, block_size=BLOCK, partial=True)


def test_the_proxy_lists_the_decode_instances_models_and_its_own_health(pd):
    models = json.loads(http(pd.url + "/v1/models"))
    assert [m["id"] for m in models["data"]] == [pd.model]
    health = json.loads(http(pd.url + "/health"))
    assert health, "the proxy's /health answered nothing"
    text = json.dumps(health)
    assert pd.prefill.url in text and pd.decode.url in text
