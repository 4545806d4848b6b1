"""The generated parts of docs/configuration.md: the key table and the LMCache key lists,
made from ``CONFIG_KEYS`` and the LMCache tables (``lmcache``) so that the docs cannot
drift from the code.

Each block sits between ``<!-- BEGIN GENERATED: name -->`` and
``<!-- END GENERATED: name -->``, named after the function that makes it.
``python -m kvtier.config.docs [docs/configuration.md]`` rewrites the blocks in place; a
test checks that they are current.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.config import CONFIG_KEYS, LMCACHE_ALIASES
from kvtier.config.keys import yaml_literal
from kvtier.config.lmcache import (
    LMCACHE_NO_EFFECT_KEYS,
    LMCACHE_PLANNED_KEYS,
    LMCACHE_UNSUPPORTED_KEYS,
    LMCACHE_UNSUPPORTED_PREFIXES,
)
from kvtier.config.sources import RESERVED_ENV_VARS

DEFAULT_DOC = Path("docs") / "configuration.md"


def _markdown_value(value: Any) -> str:
    return f"`{yaml_literal(value)}`"


def config_reference_markdown() -> str:
    """The key table of docs/configuration.md, generated from ``CONFIG_KEYS``."""
    lines = [
        "| Key | Env var | Type | Default | Allowed | LMCache name | Meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec in CONFIG_KEYS.values():
        type_name = spec.kind.__name__ + (" \\| None" if spec.nullable else "")
        lmcache = ", ".join(f"`{n}`" for n in spec.lmcache_names) or "—"
        env_var = "—" if spec.env_var in RESERVED_ENV_VARS else f"`{spec.env_var}`"
        lines.append(
            f"| `{spec.name}` | {env_var} | {type_name} | {_markdown_value(spec.default)} "
            f"| {spec.describe_allowed()} | {lmcache} | {spec.help} |"
        )
    return "\n".join(lines) + "\n"


def lmcache_reference_markdown() -> str:
    """The LMCache key lists of docs/configuration.md, generated from ``lmcache``."""

    def names(keys: Iterable[str]) -> str:
        return ", ".join(f"`{k}`" for k in sorted(keys))

    def by_feature(table: Mapping[str, tuple[str, Any]], prefixes: Mapping[str, str]) -> list[str]:
        features: dict[str, list[str]] = {}
        for key, (feature, default) in table.items():
            text = f"`{key}`" + (
                "" if default is None else f" (default {_markdown_value(default)})"
            )
            features.setdefault(feature, []).append(text)
        for prefix, feature in prefixes.items():
            features.setdefault(feature, []).append(f"any other `{prefix}*` key")
        return [f"- {feature}: " + ", ".join(keys) for feature, keys in features.items()]

    same = [n for spec in CONFIG_KEYS.values() for n in spec.lmcache_names if n == spec.name]
    lines = [
        "**Same meaning, same name:** " + names(same),
        "",
        "**Same meaning, other name:** "
        + ", ".join(f"`{alias}` → `{key}`" for alias, key in sorted(LMCACHE_ALIASES.items())),
        "",
        "**Ignored (no effect in kvtier; one warning lists them):** "
        + names(LMCACHE_NO_EFFECT_KEYS),
        "",
        "**Unsupported features** (accepted only while off: null, false, 0, an empty "
        "string/list/mapping, or LMCache's default for the key; an error otherwise):",
        "",
        *by_feature(LMCACHE_UNSUPPORTED_KEYS, LMCACHE_UNSUPPORTED_PREFIXES),
    ]
    if LMCACHE_PLANNED_KEYS:
        lines += [
            "",
            "**Not supported yet** (same rule; later kvtier versions add them as real keys):",
            "",
            *by_feature(LMCACHE_PLANNED_KEYS, {}),
        ]
    return "\n".join(lines) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "config_reference_markdown": config_reference_markdown,
    "lmcache_reference_markdown": lmcache_reference_markdown,
}


def _block_pattern(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"<!-- BEGIN GENERATED: {name} -->\n(.*?)<!-- END GENERATED: {name} -->", re.S
    )


def generated_block(doc: str, name: str) -> str | None:
    """The text of block ``name`` in ``doc``, or None when ``doc`` has no such block."""
    match = _block_pattern(name).search(doc)
    return None if match is None else match.group(1)


def regenerate(doc: str) -> str:
    """``doc`` with every generated block made afresh.

    Raises:
        ValueError: ``doc`` lacks one of the blocks.
    """
    for name, make in GENERATORS.items():
        match = _block_pattern(name).search(doc)
        if match is None:
            raise ValueError(f"no generated block {name!r}")
        doc = doc[: match.start(1)] + make() + doc[match.end(1) :]
    return doc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.config.docs",
        description="Rewrite the generated blocks of kvtier's configuration reference "
        "(the key table and the LMCache key lists) from the code, in place.",
    )
    parser.add_argument(
        "path",
        nargs="?",
        type=Path,
        default=DEFAULT_DOC,
        help=f"the Markdown file to rewrite (default: {DEFAULT_DOC})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite the generated blocks of the file ``argv`` names (default
    docs/configuration.md); 0 when done, 2 on bad arguments or a file without the blocks."""
    parser = build_parser()
    try:
        path = parser.parse_args(argv).path
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        text = path.read_text(encoding="utf-8")
        fresh = regenerate(text)
    except (OSError, ValueError) as exc:
        print(f"{parser.prog}: {path}: {exc}", file=sys.stderr)
        return 2
    if fresh != text:
        path.write_text(fresh, encoding="utf-8")
    print(f"{path}: {'regenerated' if fresh != text else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
