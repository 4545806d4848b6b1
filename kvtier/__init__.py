"""kvtier: a portable KV-cache tier for LLM serving (docs/architecture.md)."""

import importlib.metadata

try:
    __version__ = importlib.metadata.version("kvtier")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"
