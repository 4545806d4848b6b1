"""The benchmark report (``perf/report/``): rendered from the committed results and from
a synthetic results folder with a GPU device, a compression row and files it cannot read."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
from PIL import Image  # matplotlib's own dependency

PERF = Path(__file__).parents[1] / "perf"
COMMITTED = PERF / "results"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
H100 = "NVIDIA H100 80GB HBM3"


def _load_report_module():
    package = PERF / "report"
    spec = importlib.util.spec_from_file_location(
        "kvtier_perf_report", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


report = _load_report_module()


# -- helpers --------------------------------------------------------------------------------


def _sections(markdown: str) -> dict[str, str]:
    """``{"## Title": body}`` for every level-2 section."""
    sections: dict[str, str] = {}
    title = ""
    for line in markdown.splitlines():
        if line.startswith("## "):
            title = line
            sections[title] = ""
        elif title:
            sections[title] += line + "\n"
    return sections


def _section(markdown: str, starts_with: str) -> str:
    matches = [body for title, body in _sections(markdown).items() if title.startswith(starts_with)]
    assert len(matches) == 1, f"expected one section starting {starts_with!r}, got {len(matches)}"
    return matches[0]


def _device_part(section: str, device: str) -> str:
    """The part of ``section`` under ``### device`` (up to the next ``###``)."""
    _, found, rest = section.partition(f"### {device}\n")
    assert found, f"no '### {device}' subsection in:\n{section}"
    return rest.split("\n### ", 1)[0]


def _table_rows(text: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split(" | ")]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("|---")
    ]


def _row_with(text: str, *cells: str) -> list[str]:
    """The one table row whose leading cells are ``cells``."""
    rows = [r for r in _table_rows(text) if r[: len(cells)] == list(cells)]
    assert len(rows) == 1, f"expected one table row starting {cells}, got {rows} in:\n{text}"
    return rows[0]


def _assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} was not written"
    assert path.read_bytes()[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 200 and image.size[1] > 100, image.size


def _linked_pngs(markdown: str, out: Path) -> list[Path]:
    links = [line.split("](", 1)[1].rstrip(")") for line in markdown.splitlines() if "![" in line]
    assert all(link.startswith("plots/") for link in links), links  # relative, for GitHub
    return [out / link for link in links]


def _render(results: Path, out: Path) -> str:
    return report.render(results, out).read_text()


# -- the committed results --------------------------------------------------------------------


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> tuple[Path, str, Path, str]:
    """Two renders of the committed results, each into its own folder that holds a copy of
    ``perf/results`` (as ``perf/`` does), so links to the files are made as in the repo."""
    renders = []
    for name in ("a", "b"):
        out = tmp_path_factory.mktemp(f"committed-{name}")
        shutil.copytree(COMMITTED, out / "results", ignore=shutil.ignore_patterns("latest.json"))
        renders += [out, _render(out / "results", out)]
    return renders[0], renders[1], renders[2], renders[3]


def _committed_rows(unit_or_metric: str) -> list[dict]:
    rows = []
    for path in sorted(COMMITTED.glob("cpu*.json")):
        for row in json.loads(path.read_text())["results"]:
            if unit_or_metric in (row.get("unit"), row["metric"]) or row["metric"].startswith(
                unit_or_metric
            ):
                rows.append(row)
    return rows


def test_committed_report_is_deterministic(committed):
    out_a, markdown_a, out_b, markdown_b = committed
    assert markdown_a == markdown_b
    pngs_a = sorted(p.name for p in (out_a / "plots").glob("*.png"))
    assert pngs_a == sorted(p.name for p in (out_b / "plots").glob("*.png"))
    for name in pngs_a:
        assert (out_a / "plots" / name).read_bytes() == (out_b / "plots" / name).read_bytes(), name


def test_committed_report_is_up_to_date(committed):
    _, markdown, _, _ = committed
    assert (PERF / "report.md").read_text() == markdown, (
        "perf/report.md is not the render of perf/results/*.json: run `python -m perf.report`"
    )
    committed_pngs = sorted(p.name for p in (PERF / "plots").glob("*.png"))
    assert committed_pngs == sorted(p.name for p in _linked_pngs(markdown, PERF))


def test_committed_report_links_valid_pngs(committed):
    out, markdown, _, _ = committed
    pngs = _linked_pngs(markdown, out)
    assert [p.name for p in pngs] == [
        "ttft-cpu.png",
        "miss-cpu.png",
        "throughput-cpu.png",
        "throughput-nvidia-h100-80gb-hbm3.png",
        "lookups-cpu.png",
        "hashing-cpu.png",
        "compression-cpu.png",
    ]
    for png in pngs:
        _assert_png(png)
    assert sorted((out / "plots").glob("*.png")) == sorted(pngs)


def test_committed_sources_and_links(committed):
    _, markdown, _, _ = committed
    sources = _section(markdown, "## Sources")
    for name in ("cpu.json", "cpu-vllm-ttft.json"):
        machine = json.loads((COMMITTED / name).read_text())["machine"]
        row = _row_with(sources, f"[`results/{name}`](results/{name})")
        assert row[1] == "cpu" and row[3] == machine["date"], row
    assert "latest.json" not in markdown  # pytest-benchmark's raw data, never committed


def test_committed_throughput_and_lookups_tables(committed):
    _, markdown, _, _ = committed
    throughput = _device_part(_section(markdown, "## Throughput"), "cpu")
    gbps = _committed_rows("GB/s")
    assert (
        len(gbps) == 57
    )  # tiers 10, server 10 (shm, tcp x put, get x 2 baselines; tcp put, get x a raw
    # loopback socket), kernels 4 (gather, scatter,
    # RoPE torch and numba), codec 30 (5 chunks x 2 coders x encode, decode, fetch + decode),
    # peer pulls 3 (NIXL over UCX shm and tcp, the TCP protocol)
    for row in gbps:
        tier, op = report.tier_and_op(row["metric"])
        cells = _row_with(throughput, tier, op)
        assert cells[2:] == [
            report.fmt(row["value"]),
            row["baseline"],
            report.fmt(row["baseline_value"]),
            report.fmt_ratio(row["value"] / row["baseline_value"]),
        ]
    lookups = _device_part(_section(markdown, "## Lookups"), "cpu")
    for row in _committed_rows("lookups/s"):
        cells = _row_with(lookups, report.lookup_tier(row["metric"]))
        assert cells[2] == report.fmt(row["value"]) and cells[3] == row["baseline"]
        assert cells[-1] == report.fmt_ratio(row["value"] / row["baseline_value"])
    caption = [line for line in throughput.splitlines() if line.startswith("*GB/s")]
    assert len(caption) == 1 and "raw torch copy for cpu put, cpu get" in caption[0]
    (put,) = [r for r in _committed_rows("GB/s") if r["metric"] == "cpu tier put"]
    assert f"cpu put {report.fmt_ratio(put['value'] / put['baseline_value'])}" in caption[0]


def test_committed_ttft_and_miss_tables(committed):
    _, markdown, _, _ = committed
    ttft = _device_part(_section(markdown, "## Time to first token"), "cpu")
    warm = _committed_rows("ttft_warm_kvtier")
    assert len(warm) == 3
    for row in warm:
        tokens = row["metric"].split("_")[3]
        cells = _row_with(ttft, tokens)
        assert cells[1].startswith(report.fmt(row["value"]) + " (")
        assert cells[2].startswith(report.fmt(row["baseline_value"]) + " (")
        assert cells[3] == report.fmt_ratio(row["value"] / row["baseline_value"])
        assert cells[4] == f"{report.fmt(row['baseline_value'] / row['value'])}×"
    miss = _device_part(_section(markdown, "## Miss overhead"), "cpu")
    for row in _committed_rows("ttft_miss_kvtier"):
        cells = _row_with(miss, row["metric"].split("_")[3])
        lo, hi = row["paired_ratio"]["spread"]
        assert cells[3] == report.fmt_ratio(row["value"] / row["baseline_value"])
        median = report.fmt(row["paired_ratio"]["median"])
        assert cells[4] == f"{median} ({report.fmt(lo)}–{report.fmt(hi)})"
    headlines = _section(markdown, "## Headlines")
    assert "TTFT, 4000-token prompt: kvtier hit" in headlines
    # with the committed figures: 0.442 s hit vs 7.29 s cold
    assert "| 0.442 s | cold prefill 7.29 s | 0.0606× (16.5× faster) |" in headlines


def test_committed_compression_table(committed):
    _, markdown, _, _ = committed
    compression = _device_part(_section(markdown, "## Compression ratio vs error"), "cpu")
    rows = _committed_rows("compression")
    assert {r["codec"] for r in rows} == {
        "cachegen (llama_kv)",
        "cachegen (small_kv)",
        "cachegen (small_llama_kv_64)",
        "cachegen (small_llama_kv_256)",
        "cachegen (synthetic_kv)",
        "int8 (llama_kv)",
        "int8 (small_kv)",
        "int8 (small_llama_kv_64)",
        "int8 (small_llama_kv_256)",
        "int8 (synthetic_kv)",
        *(
            f"cachegen stored object ({shape})"
            for shape in ("1x64", "1x128", "2x64", "2x128", "4x64", "4x128", "8x64", "8x128")
        ),
        "cachegen stored object (model_a)",
    }
    for row in rows:
        cells = _row_with(compression, report.compression_label(report.Row("cpu", "cpu.json", row)))
        assert cells[1] == f"{report.fmt(row['value'])} x"
        assert cells[-1] == report.fmt_ratio(row["value"] / row["baseline_value"])
    assert "## Other results" not in markdown


# -- a synthetic results folder: a GPU, compression rows, unreadable files --------------------


def _machine(device: str, date: str) -> dict:
    return {"date": date, "device": device, "cpu": "x86_64", "cpu_count": 16, "torch": "2.13.0"}


def _write(path: Path, machine: dict | None, rows: list[dict]) -> None:
    path.write_text(json.dumps({"machine": machine, "results": rows}))


def _row(metric: str, value: float, unit: str, baseline: str, baseline_value, **extra) -> dict:
    return {
        "metric": metric,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "baseline_value": baseline_value,
        **extra,
    }


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    results = tmp_path_factory.mktemp("synthetic-results")
    _write(
        results / "cpu.json",
        _machine("cpu", "2030-01-02T03:04:05+00:00"),
        [
            # no "ratio" field: the report computes it
            _row("cpu tier put", 10.0, "GB/s", "raw torch copy", 20.0),
            _row("cpu tier get", 30.0, "GB/s", "raw torch copy", 20.0, ratio=1.5),
            _row("chunk hashing", 300.0, "Mtokens/s", "sha256 (same run)", 5.0, algorithm="xxh3"),
            _row("lookup 32k-token prompt (cpu)", 40_000.0, "lookups/s", "dict loop", 50_000.0),
            _row("kernel launches", 12.5, "us", "", None),  # no section takes it
        ],
    )
    _write(
        results / "cpu-compression.json",
        _machine("cpu", "2030-01-03T00:00:00+00:00"),
        [
            _row(
                "compression cachegen 8-bit", 2.0, "x", "uncompressed bf16", 1.0, ratio=2.0,
                error=0.001, error_metric="relative L2 error", codec="cachegen 8-bit",
            ),
            _row(
                "compression cachegen 4-bit", 3.5, "x", "uncompressed bf16", 1.0, ratio=3.5,
                error=0.01, error_metric="relative L2 error", codec="cachegen 4-bit",
            ),
        ],
    )  # fmt: skip
    _write(
        results / "nvidia-h100-80gb-hbm3.json",
        _machine(H100, "2030-02-01T00:00:00+00:00"),
        [
            _row("paged gather (triton)", 2000.0, "GB/s", "torch reference", 1000.0),
            _row("cpu tier get", 25.0, "GB/s", "raw torch copy", 24.0),
            _row(
                "ttft_warm_kvtier_1024_tokens", 0.01, "s", "ttft_cold_prefill_1024_tokens", 0.2
            ),  # no spreads nor rounds
            _row(
                "ttft_warm_kvtier_8192_tokens", 0.05, "s", "ttft_cold_prefill_8192_tokens", 2.0,
                spread=[0.04, 0.06], baseline_spread=[1.9, 2.1], rounds=[0.04, 0.05, 0.06],
                prompts_per_round=2,
            ),
            # per-round ratios from the rounds, no "paired_ratio": 1.1, 1.2, 1.0
            _row(
                "ttft_miss_kvtier_1024_tokens", 0.22, "s", "ttft_no_connector_1024_tokens", 0.2,
                rounds=[0.22, 0.24, 0.2], baseline_rounds=[0.2, 0.2, 0.2],
                spread=[0.2, 0.24], baseline_spread=[0.2, 0.2],
            ),
        ],
    )  # fmt: skip
    (results / "latest.json").write_text(json.dumps({"machine_info": {}, "benchmarks": []}))
    (results / "broken.json").write_text("{ not json")
    (results / "other.json").write_text(json.dumps({"rows": []}))
    _write(results / "zz-partial.json", None, [{"metric": "no value"}, {"value": 1.0}])
    return results


@pytest.fixture(scope="module")
def synthetic_render(synthetic, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("synthetic-out")
    (out / "plots").mkdir()
    (out / "plots" / "stale-device.png").write_bytes(PNG_SIGNATURE)
    return out, _render(synthetic, out)


def test_synthetic_sources(synthetic_render):
    _, markdown = synthetic_render
    sources = _section(markdown, "## Sources")
    assert _row_with(sources, "`cpu.json`")[1:] == [
        "cpu",
        "x86_64, 16 cores, torch 2.13.0",
        "2030-01-02T03:04:05+00:00",
        "5",
    ]
    assert _row_with(sources, "`nvidia-h100-80gb-hbm3.json`")[1] == H100
    # a file without a machine: named by its file; its two rows without metric/value dropped
    assert _row_with(sources, "`zz-partial.json`")[1:] == [
        "zz-partial",
        "—",
        "—",
        "0 (2 unreadable)",
    ]
    assert "`broken.json` (unreadable: JSONDecodeError)" in sources
    assert "`other.json` (not a kvtier results file" in sources
    assert "latest.json" not in markdown


def test_synthetic_gpu_device_gets_its_own_sections_and_plots(synthetic_render):
    out, markdown = synthetic_render
    throughput = _section(markdown, "## Throughput")
    assert throughput.index("### cpu\n") < throughput.index(f"### {H100}\n")  # CPU first
    gpu = _device_part(throughput, H100)
    assert _row_with(gpu, "—", "paged gather (triton)")[2:] == [
        "2,000", "torch reference", "1,000", "2.00×",
    ]  # fmt: skip
    assert _row_with(gpu, "cpu", "get")[2:] == ["25.0", "raw torch copy", "24.0", "1.04×"]
    assert "torch reference for paged gather (triton)" in gpu  # the caption's baseline
    cpu = _device_part(throughput, "cpu")
    assert _row_with(cpu, "cpu", "put")[2:] == ["10.0", "raw torch copy", "20.0", "0.500×"]
    assert _row_with(cpu, "cpu", "get")[-1] == "1.50×"
    assert "Ratio kvtier ÷ baseline: cpu put 0.500×; cpu get 1.50×." in cpu
    slug = "nvidia-h100-80gb-hbm3"
    for name in ("throughput-cpu", f"throughput-{slug}", f"ttft-{slug}", f"miss-{slug}"):
        assert f"](plots/{name}.png)" in markdown
        _assert_png(out / "plots" / f"{name}.png")
    # sections with no rows for the GPU have no GPU subsection; with none at all, none
    assert f"### {H100}" not in _section(markdown, "## Lookups")
    assert "### cpu" not in _section(markdown, "## Time to first token")


def test_synthetic_ttft_and_miss(synthetic_render):
    _, markdown = synthetic_render
    ttft = _device_part(_section(markdown, "## Time to first token"), H100)
    assert _row_with(ttft, "1024")[1:] == ["0.0100", "0.200", "0.0500×", "20.0×", "—"]
    assert _row_with(ttft, "8192")[1:] == [
        "0.0500 (0.0400–0.0600)", "2.00 (1.90–2.10)", "0.0250×", "40.0×", "2 × 3",
    ]  # fmt: skip
    miss = _device_part(_section(markdown, "## Miss overhead"), H100)
    assert _row_with(miss, "1024")[1:] == [
        "0.220 (0.200–0.240)", "0.200 (0.200–0.200)", "1.10×", "1.10 (1.00–1.20)", "—",
    ]  # fmt: skip
    headlines = _section(markdown, "## Headlines")
    assert f"| {H100} | TTFT, 8192-token prompt: kvtier hit | 0.0500 s |" in headlines


def test_synthetic_compression_section_appears(synthetic_render):
    out, markdown = synthetic_render
    compression = _section(markdown, "## Compression ratio vs error")
    assert "No results yet" not in compression
    cpu = _device_part(compression, "cpu")
    assert [r[0] for r in _table_rows(cpu)[1:]] == ["cachegen 8-bit", "cachegen 4-bit"]
    assert _row_with(cpu, "cachegen 4-bit")[1:] == [
        "3.50 x", "0.0100", "relative L2 error", "uncompressed bf16", "1.00", "3.50×",
    ]  # fmt: skip
    assert "Baseline: uncompressed bf16. Ratio: cachegen 8-bit 2.00×; cachegen 4-bit 3.50×." in cpu
    _assert_png(out / "plots" / "compression-cpu.png")


def test_synthetic_hashing_lookups_and_other(synthetic_render):
    _, markdown = synthetic_render
    hashing = _device_part(_section(markdown, "## Chunk hashing"), "cpu")
    assert _row_with(hashing, "xxh3")[1:] == ["300", "sha256 (same run)", "5.00", "60.0×"]
    lookups = _device_part(_section(markdown, "## Lookups"), "cpu")
    assert _row_with(lookups, "cpu")[2:] == ["40,000", "dict loop", "50,000", "0.800×"]
    other = _device_part(_section(markdown, "## Other results"), "cpu")
    assert _row_with(other, "kernel launches")[1:] == ["12.5", "us", "—", "—", "—"]


def test_synthetic_render_is_deterministic_and_removes_stale_plots(
    synthetic, synthetic_render, tmp_path
):
    out, markdown = synthetic_render
    assert not (out / "plots" / "stale-device.png").exists()
    assert _render(synthetic, tmp_path) == markdown
    for png in _linked_pngs(markdown, out):
        assert (tmp_path / "plots" / png.name).read_bytes() == png.read_bytes(), png.name


# -- degrading gracefully -------------------------------------------------------------------------


def test_empty_results_render_no_results_yet(tmp_path):
    (tmp_path / "results").mkdir()
    markdown = _render(tmp_path / "results", tmp_path / "out")
    for title in (
        "## Sources",
        "## Headlines",
        "## Time to first token",
        "## Miss overhead",
        "## Throughput",
        "## Lookups",
        "## Chunk hashing",
        "## Compression ratio vs error",
    ):
        assert "_No results yet._" in _section(markdown, title), title
    assert "## Other results" not in markdown and "![" not in markdown
    assert not list((tmp_path / "out").glob("plots/*.png"))


def test_cli(tmp_path, capsys):
    assert report.main(["--results", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    results = tmp_path / "results"
    results.mkdir()
    _write(results / "cpu.json", _machine("cpu", "d"), [_row("disk tier get", 2, "GB/s", "raw", 1)])
    assert report.main(["--results", str(results), "--out", str(tmp_path / "out")]) == 0
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert _row_with(markdown, "disk", "get")[2:] == ["2.00", "raw", "1.00", "2.00×"]
    _assert_png(tmp_path / "out" / "plots" / "throughput-cpu.png")


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (44716.4, "44,716"),
        (285.05, "285"),
        (17.252, "17.3"),
        (4.596, "4.60"),
        (0.99963, "1.00"),
        (0.0646346, "0.0646"),
        (0.016231, "0.0162"),
        (0.0, "0"),
        (None, "—"),
    ],
)
def test_fmt(value, text):
    assert report.fmt(value) == text


def test_metric_parsing():
    assert report.tier_and_op("redis tier get") == ("redis", "get")
    assert report.tier_and_op("engine store (gather + put)") == ("engine", "store (gather + put)")
    assert report.tier_and_op("paged scatter") == ("—", "paged scatter")
    assert report.lookup_tier("lookup 32k-token prompt (s3)") == "s3"
    assert report.slug(H100) == "nvidia-h100-80gb-hbm3"
