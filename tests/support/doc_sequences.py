"""The command sequences the documentation shows, and where it shows them.

Each sequence is one bash script under ``docs/sequences/``; a document shows it between
markers, and the block between them is the script's text, byte for byte::

    <!-- sequence: docs/sequences/vllm-server.sh -->
    ```bash
    ...the script...
    ```
    <!-- /sequence -->

    python tests/support/doc_sequences.py          # rewrite every marked block from its script
    python tests/support/doc_sequences.py --check  # exit 1 when a block differs

``tests/test_doc_sequences.py`` checks the blocks and the scripts' conventions;
``tests/engines/test_vllm_doc_sequences.py`` runs every script against real engines.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEQUENCES = ROOT / "docs" / "sequences"
SHOWN = re.compile(
    r"^<!-- sequence: (?P<script>\S+) -->\n(?:```bash\n(?P<body>.*?)^```\n)?<!-- /sequence -->$",
    re.DOTALL | re.MULTILINE,
)
FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```$", re.DOTALL | re.MULTILINE)
# A variable a script reads with a default: NAME=${NAME:-default}
DEFAULTED = re.compile(r"\b(?P<name>[A-Z][A-Z0-9_]*)=\$\{(?P=name):-(?P<default>[^}]*)\}")


@dataclass(frozen=True, slots=True)
class Shown:
    """One marked block: the document, the script it names, the block's text ("" for
    markers with no block between them yet: ``main`` fills them in)."""

    doc: Path
    script: str
    body: str


def documents() -> list[Path]:
    """The documents a user reads: the README and docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def scripts() -> list[Path]:
    return sorted(SEQUENCES.glob("*.sh"))


def shown_blocks(doc: Path) -> list[Shown]:
    return [Shown(doc, m["script"], m["body"] or "") for m in SHOWN.finditer(doc.read_text())]


def unmarked_blocks(doc: Path) -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced block outside the sequence markers."""
    return [(m["lang"], m["body"]) for m in FENCE.finditer(SHOWN.sub("", doc.read_text()))]


def defaults(script: Path) -> dict[str, str]:
    """The variables ``script`` reads from the environment, with their defaults."""
    return {m["name"]: m["default"] for m in DEFAULTED.finditer(script.read_text())}


def synced(text: str) -> str:
    """``text`` with every marked block replaced by its script's current text."""

    def block(match: re.Match) -> str:
        body = (ROOT / match["script"]).read_text()
        return f"<!-- sequence: {match['script']} -->\n```bash\n{body}```\n<!-- /sequence -->"

    return SHOWN.sub(block, text)


def main(argv: list[str]) -> int:
    stale = [doc for doc in documents() if synced(doc.read_text()) != doc.read_text()]
    if "--check" in argv:
        for doc in stale:
            print(f"{doc.relative_to(ROOT)}: a sequence block differs from its script")
        return 1 if stale else 0
    for doc in stale:
        doc.write_text(synced(doc.read_text()))
        print(f"rewrote {doc.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
