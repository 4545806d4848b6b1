"""The tiers below the engine: CPU, disk and remote stores, their policies and the
manager that routes across them (docs/tiers.md)."""
