"""The registry of remote stores: which module opens each ``remote_url`` scheme.

As in vLLM's ``kv_offload/factory.py``, a scheme is registered by name with the module
that implements it, and that module is imported only when a remote of its scheme is
opened: redis-py loads only for a Redis remote, boto3 only for an S3 one.
``StorageManager`` asks it for the module that opens the URL.

The schemes a user may write are declared by the config (``REMOTE_SCHEMES`` in
``kvtier.config.remote``), which checks ``remote_url`` against them; a test holds this
registry to exactly those schemes. A new scheme is one module, its name in
``REMOTE_SCHEMES`` and one ``register`` line below. The module defines ``open_remote`` with the signature of
``kvtier.storage.remote.RemoteOpener``: it parses the URL (a ValueError names
``remote_url`` and the accepted form) and returns the tier. A byte store (a
``BlobStore``) becomes a tier through ``remote.open_blob_tier``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

from kvtier.config.remote import REMOTE_SCHEMES, redact_url, url_scheme


@dataclass(frozen=True, slots=True)
class RemoteScheme:
    """One ``remote_url`` scheme.

    Attributes:
        name: the scheme, lower case (``redis``).
        module: the module that defines ``open_remote`` for it (imported on first use).
        extra: the pip extra (``pip install 'kvtier[extra]'``) that installs its client
            library, or None when it needs none.
    """

    name: str
    module: str
    extra: str | None = None


_SCHEMES: dict[str, RemoteScheme] = {}


def register(names: str | Iterable[str], module: str, extra: str | None = None) -> None:
    """Make URLs of each scheme in ``names`` open through ``module``.

    Raises:
        ValueError: a scheme is registered already.
    """
    for name in [names] if isinstance(names, str) else names:
        scheme = name.lower()
        if scheme in _SCHEMES:
            raise ValueError(f"remote scheme {scheme!r} is registered already")
        _SCHEMES[scheme] = RemoteScheme(scheme, module, extra)


# Valkey speaks the Redis protocol: its schemes are aliases of Redis's.
register(
    (
        *("redis", "rediss", "redis-cluster", "rediss-cluster"),
        *("valkey", "valkeys", "valkey-cluster", "valkeys-cluster"),
        "unix",
    ),
    "kvtier.storage.redis_store",
    extra="redis",
)
register("s3", "kvtier.storage.s3_store", extra="s3")
register("fs", "kvtier.storage.shared_fs")
register(("kvtier", "lm"), "kvtier.storage.node_store")  # `kvtier serve`; lm:// as LMCache


def remote_schemes() -> tuple[str, ...]:
    """Every registered scheme, in registration order."""
    return tuple(_SCHEMES)


def scheme_of(url: str) -> RemoteScheme | None:
    """The registered scheme of ``url`` (matched case-insensitively), or None."""
    name = url_scheme(url)
    return None if name is None else _SCHEMES.get(name)


def load_module(url: str) -> ModuleType:
    """The module that opens ``url``, imported now.

    Raises:
        ValueError: the scheme is not registered, or its client library is not installed
            (the message names the pip extra that installs it).
    """
    scheme = scheme_of(url)
    if scheme is None:
        allowed = ", ".join(REMOTE_SCHEMES)
        raise ValueError(f"remote_url {redact_url(url)!r}: expected a URL with scheme {allowed}")
    try:
        return importlib.import_module(scheme.module)
    except ImportError as exc:
        if scheme.extra is None:
            raise
        raise ValueError(
            f"remote_url needs an optional dependency that is not installed ({exc.name}): "
            f"pip install 'kvtier[{scheme.extra}]'"
        ) from None
