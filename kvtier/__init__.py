"""kvtier: a portable KV-cache tier for LLM serving (docs/architecture.md)."""
