"""``kvtier proxy``: an OpenAI-compatible router for prefill/decode disaggregation.

Each completion request is prefilled on a prefill instance (``max_tokens=1``; its KV goes
to the kvtier tier those engines share), then sent as it came to a decode instance, which
loads that KV instead of computing it; the decode instance's answer is passed back.
The ``kvtier proxy`` command (:mod:`kvtier.commands.proxy`) imports aiohttp only when it
runs.

    instances    the engine instances, their up/down state, round_robin / least_loaded /
                 cache_aware picks
    counters     the proxy's Prometheus series
    messages     the prefill leg's body, headers passed on, OpenAI-style errors
    prompts      a request's /tokenize body, the token cache, cached tokens of an answer
    cache_aware  the cache_aware policy: KV event subscribers, index, per-request score
    health_probe the GET /health probe that brings a down instance back up
    app          the aiohttp server and the two legs of a request
"""
