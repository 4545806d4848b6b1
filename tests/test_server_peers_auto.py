"""``--peer-transport auto`` on both servers, as an operator runs them: server b names
server a as its peer, server a has no peers of its own (the PD-across-nodes topology of
docs/disaggregated.md). docs/server.md says a sets NIXL up when a peer first asks for its
agent, so b's pulls are NIXL READs."""

from __future__ import annotations

import functools

import pytest
import torch
from support.kvtier_server import KVTierServerProcess

from kvtier.server.nixl import NixlUnavailable, import_nixl
from kvtier.storage.serde import make_serde
from kvtier.storage.wire import encode

NS = "org%2Fmodel-a"
NAME = "kvtier1@org%2Fmodel-a@1@0@bfloat16@{:032x}"

try:
    import_nixl()
except NixlUnavailable as exc:
    pytest.skip(f"{exc} (make test installs nixl-cu13 --no-deps)", allow_module_level=True)


@functools.cache
def blob(i: int) -> bytes:
    """A wire-format object of ``NAME.format(i)`` (made once: its header records when)."""
    tensor = torch.full((2 * 64 * 128,), float(i), dtype=torch.bfloat16).view(2, 1, -1, 128)
    return b"".join(bytes(p) for p in encode(NAME.format(i), tensor, make_serde("naive")))


def test_a_holder_without_peers_of_its_own_is_pulled_with_nixl_in_auto():
    pool = ("--max-local-cpu-size", "0.1")
    with (
        KVTierServerProcess(*pool, admin=True) as a,
        KVTierServerProcess(*pool, "--peer", a.url, admin=True) as b,
    ):
        writer = a.client(NS)
        writer.put_many([(NAME.format(i), [blob(i)]) for i in range(2)])
        writer.close()
        reader = b.client(NS)
        got = reader.get_many([NAME.format(0), NAME.format(1)])
        reader.close()
        assert [bytes(g) for g in got] == [blob(0), blob(1)]
        values = b.admin("/stats")[1]
        assert values.get("peer_bytes_nixl", 0) > 0 and values.get("peer_fallbacks", 0) == 0, (
            {k: v for k, v in values.items() if k.startswith("peer")},
            b.log()[-1000:],
        )
