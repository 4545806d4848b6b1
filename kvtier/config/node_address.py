"""The address of a ``kvtier serve``: ``kvtier://host:port`` (and LMCache's spelling
``lm://host:port``, read the same way), with the client's options in the query
(``?shm=0`` turns the shared-memory offer off, ``?shm_mb=N`` sizes the segment).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import parse_qsl, urlsplit

from kvtier.config.remote import redact_url

SCHEMES = ("kvtier", "lm")
# The sizes of a client's shared-memory segment (``?shm_mb=``), which the server checks too.
MIN_SEGMENT_BYTES = 1 << 16
DEFAULT_SEGMENT_BYTES = 64 << 20
_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


@dataclass(frozen=True, slots=True)
class ServerAddress:
    """A parsed ``kvtier://host:port[?shm=0|1][&shm_mb=N]``."""

    host: str
    port: int
    shm: bool = True
    shm_bytes: int = DEFAULT_SEGMENT_BYTES


def parse_server_address(url: str, setting: str = "remote_url") -> ServerAddress:
    """The address and options of ``kvtier://host:port`` or ``lm://host:port`` (any
    other scheme is refused).

    Raises:
        ValueError: naming ``setting`` and the accepted form.
    """
    form = (
        f"{setting} {redact_url(url)!r}: expected kvtier://host:port (or lm://host:port), optionally "
        "with ?shm=0 (no shared memory) or ?shm_mb=N, e.g. kvtier://127.0.0.1:65432"
    )
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise ValueError(form) from None
    options = dict(query)
    if (
        parts.scheme.lower() not in SCHEMES
        or not host
        or not port  # None, or 0: no server listens on port 0
        or parts.path not in ("", "/")
        or len(options) != len(query)
    ):
        raise ValueError(form)
    address = ServerAddress(host, port)
    try:
        for name, value in options.items():
            if name == "shm":
                address = replace(address, shm=_FLAGS[value.lower()])
            elif name == "shm_mb":
                size = int(float(value) * 2**20)
                if not MIN_SEGMENT_BYTES <= size <= 1 << 40:
                    raise ValueError
                address = replace(address, shm_bytes=size)
            else:
                raise ValueError
    except (KeyError, ValueError):
        raise ValueError(form) from None
    return address


def parse_server_url(url: str) -> tuple[str, int]:
    """``(host, port)`` of ``kvtier://host:port`` or ``lm://host:port`` (see
    ``parse_server_address``)."""
    address = parse_server_address(url)
    return address.host, address.port


def host_port(host: str, port: int) -> str:
    """``host:port`` as a URL writes it: an IPv6 host in brackets (``[::1]:65432``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
