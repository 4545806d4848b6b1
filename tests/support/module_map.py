"""The module map of docs/architecture.md, generated from each module's docstring (its
first sentence; a long one up to its colon), between ``<!-- module-map:begin -->`` and ``<!-- module-map:end -->``.

    python tests/support/module_map.py        # rewrite docs/architecture.md's map
    python tests/support/module_map.py --check  # exit 1 when it is stale

``tests/test_architecture.py`` fails when the committed map differs from a fresh one.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvtier_kernels", "kvtier")
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- module-map:begin -->", "<!-- module-map:end -->"
LONG = 140  # a first sentence longer than this is cut at its colon


def summary(path: Path) -> str | None:
    """The first sentence of the module's docstring (None: it has none)."""
    docstring = ast.get_docstring(ast.parse(path.read_text(), str(path)))
    if not docstring:
        return None
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?\.)(\s|$)", paragraph)
    sentence = match.group(1) if match else paragraph
    head, colon, _ = sentence.partition(": ")
    if len(sentence) > LONG and colon and len(head) >= 30:
        sentence = head + "."  # what it is, without the list of what it holds
    return sentence.replace("|", "\\|")


def module_map() -> str:
    """One table per package directory: module file, what it is."""
    out = []
    for package in PACKAGES:
        folders = sorted({p.parent for p in (ROOT / package).rglob("*.py")})
        for folder in folders:
            rows = []
            for path in sorted(folder.glob("*.py")):
                rows.append(f"| `{path.name}` | {summary(path) or ''} |")
            out += [
                f"**`{folder.relative_to(ROOT)}/`**",
                "",
                "| module | what it is |",
                "|---|---|",
            ]
            out += [*rows, ""]
    return "\n".join(out).rstrip("\n")


def regenerate(text: str) -> str:
    """``text`` with the block between the markers replaced by a fresh map."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{DOC.name} has no {BEGIN} ... {END} block")
    return text[: start + len(BEGIN)] + "\n" + module_map() + "\n" + text[end:]


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    fresh = regenerate(text)
    if "--check" in argv:
        if fresh != text:
            print(f"{DOC.relative_to(ROOT)}: module map is stale; run python {__file__}")
            return 1
        print(f"{DOC.relative_to(ROOT)}: module map up to date")
        return 0
    DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
