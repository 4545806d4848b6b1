"""``kvtier serve``: one cache process per node, shared by every engine on it.

Engines reach it as the remote tier ``kvtier://host:port`` (``kvtier.storage.node_store``,
over the frames of ``kvtier.storage.node_protocol``). The server stores the opaque blobs
that a client's ``RemoteTier`` produces (wire-format objects with their checksums) by
name and never decodes KV.

    shm       the server's side of the same-host shared-memory path
    blobs     bounded in-memory LRU and disk directory of blobs
    cache     memory → disk → peers → write-through remote, per client namespace
    peers     other servers asked for missed chunks (lookups, verified pulls)
    discovery peers found in a shared Redis/Valkey (registrations with a TTL)
    nixl      NIXL as the data plane of pulls: one-sided READs between memory pools
    leases    blobs pinned while a peer reads them one-sidedly
    server    the asyncio TCP server (one coroutine per connection)
    admin     /health, /stats, /metrics, /clear, /lookup over HTTP (aiohttp)
    serve     the server assembled (cache, TCP server, admin API), run until a signal
"""
