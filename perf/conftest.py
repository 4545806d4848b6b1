"""The benchmarks' command-line options (``--save-results``; its use: ``benchmarks/conftest.py``).

pytest knows an option only from a conftest it loads before it reads the command line: one
on the path to what it is asked to run. Here they serve ``pytest perf`` (``make bench``) and
``pytest perf/benchmarks/<file>`` alike.
"""

from __future__ import annotations


def pytest_addoption(parser):
    parser.addoption(
        "--save-results",
        action="store_true",
        help="merge this run's figures into the committed perf/results/ files (make bench "
        "does); without it they go to perf/results/scratch/",
    )
