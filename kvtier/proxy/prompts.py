"""A request's prompt as the engine tokenizes it, and its cached tokens as the engine
reports them: the ``/tokenize`` body for a completion request, a bounded cache of token
ids, and ``usage.prompt_tokens_details.cached_tokens`` from an answer.

``/tokenize`` (vLLM's OpenAI server, ``vllm.entrypoints.serve.tokenize.protocol``) takes
either ``{"model", "prompt", "add_special_tokens"}`` (default True, as completions) or
``{"model", "messages", "add_generation_prompt", "continue_final_message",
"add_special_tokens", "chat_template", "chat_template_kwargs", "tools"}``
(``add_special_tokens`` default False, as chat). The fields below are copied from the
client's request, so the engine's chat template renders the same text. A chat request's
``reasoning_effort`` becomes ``chat_template_kwargs.enable_thinking`` as vLLM's chat
endpoint does. Not computable here (the request is then scored on nothing): prompts with
images or other non-text parts (their block hashes carry multimodal hashes), and
``prompt_embeds``.
"""

from __future__ import annotations

import array
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

CHAT_PATH = "/v1/chat/completions"
CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)
TOKEN_CACHE_BYTES = 64 << 20


def tokenize_body(path: str, body: dict) -> dict | list[int] | None:
    """What to POST to ``/tokenize`` for a client request to ``path``; a list: the
    request already has its token ids; None: it cannot be scored."""
    model = body.get("model")
    if path == CHAT_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(_text_only(m) for m in messages):
            return None
        out: dict[str, Any] = {"model": model, "messages": messages}
        for name in CHAT_FIELDS:
            if body.get(name) is not None:
                out[name] = body[name]
        effort = body.get("reasoning_effort")
        kwargs = body.get("chat_template_kwargs") or {}
        if effort is not None and isinstance(kwargs, dict) and "enable_thinking" not in kwargs:
            out["chat_template_kwargs"] = {**kwargs, "enable_thinking": effort != "none"}
        return out
    if body.get("prompt_embeds") is not None:
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: scored by its first prompt
    if isinstance(prompt, list):
        return prompt if are_token_ids(prompt) else None
    if not isinstance(prompt, str):
        return None
    return {
        "model": model,
        "prompt": prompt,
        "add_special_tokens": body.get("add_special_tokens", True),
    }


def are_token_ids(values: list) -> bool:
    """Whether every value can be a token id (a prompt the engine will refuse is scored
    on nothing)."""
    return all(type(v) is int and 0 <= v < 1 << 63 for v in values)


def encodable(text: str) -> bool:
    """Whether UTF-8 can encode ``text``: JSON can escape a lone surrogate, which no
    engine can hash (a request with one in a field that enters its hashes is scored on
    nothing)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _text_only(message: Any) -> bool:
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if isinstance(content, list):
        return all(isinstance(p, dict) and p.get("type") == "text" for p in content)
    return True


class TokenCache:
    """Token ids by ``/tokenize`` body, least recently used out past ``max_bytes``
    (the body's JSON and 4 bytes per token counted)."""

    def __init__(self, max_bytes: int = TOKEN_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, array.array] = OrderedDict()

    @staticmethod
    def key(body: dict) -> str:
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    def get(self, key: str) -> array.array | None:
        tokens = self._entries.get(key)
        if tokens is not None:
            self._entries.move_to_end(key)
        return tokens

    def put(self, key: str, tokens: Sequence[int]) -> array.array:
        stored = (
            array.array("I", tokens)
            if all(0 <= t < 1 << 32 for t in tokens)
            else array.array("q", tokens)
        )
        if key in self._entries:
            return self._entries[key]
        self._entries[key] = stored
        self.bytes += len(key) + stored.itemsize * len(stored)
        while self.bytes > self.max_bytes and len(self._entries) > 1:
            old_key, old = self._entries.popitem(last=False)
            self.bytes -= len(old_key) + old.itemsize * len(old)
        return stored

    def __len__(self) -> int:
        return len(self._entries)


def cached_tokens(answer: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a decoded answer (None: absent)."""
    if not isinstance(answer, dict):
        return None
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


def cached_tokens_in_json(raw: bytes) -> int | None:
    """``cached_tokens`` of a JSON answer's bytes (None: absent or not JSON)."""
    if b"cached_tokens" not in raw:
        return None
    try:
        return cached_tokens(json.loads(raw))
    except ValueError:
        return None


def cached_tokens_in_sse(tail: bytes) -> int | None:
    """``cached_tokens`` of the last SSE event carrying usage in ``tail`` (the end of a
    stream; with ``stream_options.include_usage`` the last chunk before [DONE])."""
    if b"cached_tokens" not in tail:
        return None
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b"cached_tokens" in line:
            try:
                return cached_tokens(json.loads(line[6:]))
            except ValueError:
                return None
    return None
