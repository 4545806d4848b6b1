"""KV chunks to test and measure the CacheGen codec on (``KV_2LTD``: ``[2, L, T, D]``).

- :func:`synthetic_kv`: channel-wise log-normal magnitudes, outlier K channels, per-token
  magnitudes (the structure reported for trained models' KV).
- :func:`tiny_model_kv`: K and V of a small pre-norm transformer written out in torch.
- :func:`llama_kv`: K and V of a real forward pass of a ``transformers`` Llama with random
  weights (built locally, nothing downloaded), as vLLM would cache them (K after RoPE).

:func:`assert_within_bound` checks a decoded chunk against the codec's stated bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch


def synthetic_kv(layers: int = 8, tokens: int = 256, hidden: int = 512, seed: int = 0):
    """Channel-wise magnitudes (log-normal), 4 outlier K channels, per-token magnitudes."""
    g = torch.Generator().manual_seed(seed)
    channel = torch.exp(torch.randn(2, layers, 1, hidden, generator=g) * 0.5)
    channel[0, :, :, :4] *= 15
    token = torch.exp(torch.randn(2, layers, tokens, 1, generator=g) * 0.3)
    mean = torch.randn(2, layers, 1, hidden, generator=g) * 0.5
    x = (mean + torch.randn(2, layers, tokens, hidden, generator=g)) * channel * token
    return x.to(torch.bfloat16)


def tiny_model_kv(layers: int = 4, tokens: int = 128, hidden: int = 256, seed: int = 0):
    """K and V of a random-weight pre-norm transformer (attention + MLP) over random
    token embeddings, with RoPE on K (the per-pair rotation real keys carry)."""
    g = torch.Generator().manual_seed(seed)
    heads, head = 4, hidden // 4
    h = torch.randn(tokens, hidden, generator=g)
    inv_freq = 10000.0 ** (-torch.arange(0, head, 2).float() / head)
    angle = torch.arange(tokens).float()[:, None] * inv_freq[None, :]
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    mask = torch.full((tokens, tokens), float("-inf")).triu(1)
    ks, vs = [], []
    for _ in range(layers):
        w = [torch.randn(hidden, hidden, generator=g) / hidden**0.5 for _ in range(6)]
        n = h / h.pow(2).mean(-1, keepdim=True).sqrt()
        q, k, v = ((n @ w[i]).view(tokens, heads, head).transpose(0, 1) for i in range(3))
        rot = lambda t: t * cos + torch.cat([-t[..., head // 2 :], t[..., : head // 2]], -1) * sin  # noqa: E731
        q, k = rot(q), rot(k)
        a = torch.softmax(q @ k.transpose(1, 2) / head**0.5 + mask, -1) @ v
        h = h + a.transpose(0, 1).reshape(tokens, hidden) @ w[3]
        n = h / h.pow(2).mean(-1, keepdim=True).sqrt()
        h = h + torch.relu(n @ w[4]) @ w[5]
        ks.append(k.transpose(0, 1).reshape(tokens, hidden))
        vs.append(v.transpose(0, 1).reshape(tokens, hidden))
    return torch.stack([torch.stack(ks), torch.stack(vs)]).to(torch.bfloat16)


def llama_kv(
    *,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    head_size: int = 64,
    tokens: int = 256,
    vocab_size: int = 1024,
    seed: int = 0,
    weight_std: float | None = None,
) -> torch.Tensor:
    """K and V (bf16, ``[2, num_layers, tokens, num_kv_heads * head_size]``) of one
    forward pass of a random-weight ``transformers`` Llama (default init, as
    ``from_config`` draws it; ``weight_std``: every matrix redrawn from N(0, std), as the
    engine tests' models are) over random token ids; K is post-RoPE, as an engine caches it.
    Needs ``transformers`` (installed by the test extras)."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    hidden = num_heads * head_size
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_size,
        max_position_embeddings=max(tokens, 128),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    if weight_std is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, weight_std)
    ids = torch.randint(0, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        cache = model(ids, use_cache=True, past_key_values=DynamicCache()).past_key_values
    planes = []
    for which in ("keys", "values"):
        layers = []
        for layer in range(num_layers):
            t = _layer_tensor(cache, layer, which)  # [1, kv_heads, tokens, head_size]
            layers.append(t[0].transpose(0, 1).reshape(tokens, num_kv_heads * head_size))
        planes.append(torch.stack(layers))
    return torch.stack(planes).to(torch.bfloat16)


def _layer_tensor(cache, layer: int, which: str) -> torch.Tensor:
    """One layer's K or V from a ``DynamicCache`` across transformers versions."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return getattr(cache.layers[layer], which)
    return (cache.key_cache if which == "keys" else cache.value_cache)[layer]


OUT_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def assert_within_bound(chunk, out, params):
    """|x - x_hat| <= scale/(2n) + 2^-20 scale + u scale, checked per (kv, layer)."""
    x = chunk.float()
    scale = x.abs().amax(-1, keepdim=True)
    u = OUT_ROUNDING[out.dtype]
    for kv, name in enumerate(("k_levels", "v_levels")):
        for layer, n in enumerate(params[name]):
            err = (out[kv, layer].float() - x[kv, layer]).abs()
            bound = scale[kv, layer] * (1 / (2 * n) + 2.0**-20 + u)
            excess = err - bound
            if (excess > 0).any():
                t, d = np.unravel_index(int(excess.argmax()), tuple(err.shape))
                pytest.fail(
                    f"{name[0]} layer {layer} token {t} channel {d}: error {err[t, d]:.4g} "
                    f"exceeds bound {bound[t, 0]:.4g} (n={n})"
                )
