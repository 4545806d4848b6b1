"""``kvtier serve``: one cache process per node, shared by every engine on it.

Engines reach it as the remote tier ``kvtier://host:port`` (``client``). The server
stores the opaque blobs that a client's ``RemoteTier`` produces (wire-format objects
with their checksums) by name and never decodes KV.

    protocol  frames: magic, version, op, request id, CBOR header, payload
    client    the BlobStore of kvtier:// and lm:// (registered in storage.remotes)
    blobs     bounded in-memory LRU and disk directory of blobs
    cache     memory → disk → write-through remote, per client namespace
    server    the asyncio TCP server (one coroutine per connection)
    admin     /health, /stats, /metrics, /clear, /lookup over HTTP (aiohttp)
    serve     the server assembled (cache, TCP server, admin API), run until a signal
"""
