"""The benchmark report: ``perf/report.md`` and its plots, rendered from ``perf/results/``.

    python -m perf.report [--results perf/results] [--out perf]

Reads every kvtier results file in ``--results`` (``<device>.json``,
``<device>-<suffix>.json``, as ``perf/benchmarks/conftest.py`` writes them;
pytest-benchmark's raw ``latest.json`` is ignored, any other file without a ``results``
list is named as not read) and writes ``<out>/report.md`` with PNG plots in
``<out>/plots/`` (matplotlib, Agg, no pyplot state). Rows are grouped by the device their
file's ``machine`` names, so results committed from a GPU machine
(``nvidia-h100-80gb-hbm3.json``, …) get their own subsection and plot in every section
they have rows for.

- ``results``: the files read, their rows and devices;
- ``sections``: which section takes each row;
- ``formatting``: figures and markdown tables;
- ``plots``: the figures;
- ``markdown``: the report itself (``render``); ``cli``: the command line.

Sections, and the rows that feed them:

- time to first token, cold vs warm — ``ttft_warm_kvtier_<N>_tokens`` (baseline: cold
  prefill) from ``perf/benchmarks/test_bench_vllm_ttft.py``;
- miss overhead — ``ttft_miss_kvtier_<N>_tokens`` (baseline: no connector), with the
  per-round ratios;
- throughput — every row in GB/s, by tier and op (``"<tier> tier <op>"``,
  ``"engine <op> (…)"``, anything else as it is named);
- lookups — every row in lookups/s, the tier in the metric's parentheses;
- chunk hashing — rows named ``chunk hashing`` (Mtokens/s, per ``algorithm``);
- compression ratio vs error — rows whose metric starts with ``compression``: ``value`` is
  the compression ratio (unit ``x``), ``error`` the reconstruction error, ``error_metric``
  its name, ``codec`` an optional label; "no results yet" until a benchmark records one;
- other results — any row no section takes, so that none is dropped silently.

NOTE: the output depends only on the JSON inputs (and the matplotlib version for the
PNG pixels): no clock is read, files and devices are sorted, and PNGs carry no
``Software`` stamp. PNGs in ``<out>/plots/`` that this render did not write are removed,
so a plot never outlives its data.
"""

from .cli import main
from .formatting import fmt, fmt_ratio, slug
from .markdown import render
from .results import Row
from .sections import compression_label, lookup_tier, tier_and_op

__all__ = [
    "Row",
    "compression_label",
    "fmt",
    "fmt_ratio",
    "lookup_tier",
    "main",
    "render",
    "slug",
    "tier_and_op",
]
