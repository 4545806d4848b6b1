"""Tests for kvtier.config: sources and precedence, parsing, errors, LMCache compatibility."""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier import config_docs
from kvtier.config import CONFIG_KEYS, LMCACHE_ALIASES, ConfigError, KVTierConfig, load_config
from kvtier.config_blend import blend_schedule
from kvtier.config_keys import parse_levels
from kvtier.config_lmcache import (
    LMCACHE_NO_EFFECT_KEYS,
    LMCACHE_PLANNED_KEYS,
    LMCACHE_UNSUPPORTED_KEYS,
    is_switched_off,
)
from kvtier.config_sources import RESERVED_ENV_VARS

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

# A realistic LMCache v1 YAML for a CPU-offload deployment: shared keys, an alias, no-effect
# operational knobs, and unsupported / not-yet-supported features left switched off.
LMCACHE_YAML = """\
# LMCache config
chunk_size: 512
local_cpu: true
max_local_cache_size: 20   # old LMCache name of max_local_cpu_size
cache_policy: lru
save_unfull_chunk: true
local_disk: null
max_local_disk_size: 0
remote_url: null
remote_serde: "naive"
use_layerwise: false
save_decode_cache: false
blocking_timeout_secs: 10
enable_blending: false
blend_special_str: " # # "
enable_p2p: false
enable_controller: false
enable_pd: false
pd_role: null
nixl_buffer_size: null
lmcache_instance_id: "lmcache_default_instance"
py_enable_gc: true
numa_mode: null
internal_api_server_enabled: false
internal_api_server_port_start: 6999
extra_config:
  some_plugin_option: 1
"""


def write(tmp_path: Path, text: str, name: str = "kvtier.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems_of(excinfo: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return excinfo.value.problems


def assert_one_problem_mentions(error: ConfigError, *fragments: str) -> None:
    """Exactly one problem, and it names every fragment (key, value, origin, allowed...)."""
    assert len(error.problems) == 1, error.problems
    missing = [f for f in fragments if f not in error.problems[0]]
    assert not missing, f"problem {error.problems[0]!r} does not mention {missing}"


# --------------------------------------------------------------------------------------
# Defaults and the config object
# --------------------------------------------------------------------------------------


def test_defaults() -> None:
    cfg = load_config(env={})
    assert cfg == KVTierConfig()
    assert cfg.to_dict() == {
        "chunk_size": 256,
        "local_cpu": True,
        "max_local_cpu_size": 5.0,
        "cache_policy": "LRU",
        "hash_algorithm": "sha256_cbor",
        "hash_seed": "vllm-none-hash",
        "save_unfull_chunk": False,
        "kernel_backend": "auto",
        "precompile_kernels": False,
        "tuning_dir": None,
        "model_name": None,
        "key_salt": None,
        "pool_alignment": 256,
        "verify_checksums": True,
        "kv_layout": None,
        "use_layerwise": False,
        "enable_blending": False,
        "blend_special_str": " # # ",
        "blend_recompute_ratios": "0.15",
        "blend_check_layers": "0",
        "blend_min_tokens": 256,
        "enable_async_loading": False,
        "save_decode_cache": False,
        "lookup_timeout_ms": 2000,
        "min_retrieve_tokens": 0,
        "kv_load_failure_policy": "recompute",
        "pd_wait_ms": 0,
        "producer_store_timeout_ms": 30000,
        "metrics_port": None,
        "metrics_host": "127.0.0.1",
        "store_queue_size": 256,
        "local_disk": None,
        "max_local_disk_size": 20.0,
        "local_disk_o_direct": False,
        "remote_url": None,
        "remote_serde": "naive",
        "cachegen_k_levels": "",
        "cachegen_v_levels": "",
        "cachegen_device": "auto",
        "remote_timeout_ms": 1000,
        "remote_reconnect_max_ms": 5000,
        "remote_max_concurrency": 16,
        "remote_username": None,
        "remote_password": None,
        "remote_ttl_secs": None,
        "remote_tls_ca_file": None,
        "remote_tls_cert_file": None,
        "remote_tls_key_file": None,
        "server_token": None,
        "s3_endpoint_url": None,
        "s3_region": None,
        "s3_access_key_id": None,
        "s3_secret_access_key": None,
    }
    assert cfg.max_local_cpu_bytes == 5 * 2**30
    assert cfg.ignored_lmcache_keys == ()
    assert set(cfg.sources.values()) == {"default"}


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_CHUNK_SIZE", "128")
    assert load_config().chunk_size == 128


def test_every_spec_default_is_valid_and_matches_its_field() -> None:
    defaults = KVTierConfig()
    for name, spec in CONFIG_KEYS.items():
        assert spec.name == name
        assert spec.env_var == "KVTIER_" + name.upper()
        assert getattr(defaults, name) == spec.default
        assert spec.help


def test_config_is_frozen_and_direct_construction_validates() -> None:
    cfg = KVTierConfig(chunk_size=16, cache_policy="mru")
    assert cfg.cache_policy == "MRU"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_size = 32  # type: ignore[misc]
    with pytest.raises(ConfigError) as excinfo:
        KVTierConfig(chunk_size=0)
    assert_one_problem_mentions(excinfo.value, "chunk_size", "0", "1 to 1048576")
    with pytest.raises(ConfigError):
        dataclasses.replace(cfg, pool_alignment=3)
    assert dataclasses.replace(cfg, chunk_size=64).chunk_size == 64


def test_config_and_error_pickle() -> None:
    cfg = load_config(overrides={"chunk_size": 16, "model_name": "m"}, env={})
    clone = pickle.loads(pickle.dumps(cfg))
    assert clone == cfg
    assert clone.sources == cfg.sources
    error = ConfigError(["a", "b"])
    assert pickle.loads(pickle.dumps(error)).problems == ["a", "b"]


def test_max_local_cpu_bytes_uses_binary_gigabytes() -> None:
    assert KVTierConfig(max_local_cpu_size=0.5).max_local_cpu_bytes == 2**29
    assert KVTierConfig(max_local_cpu_size=2).max_local_cpu_bytes == 2 * 2**30


# --------------------------------------------------------------------------------------
# Precedence and sources
# --------------------------------------------------------------------------------------


def test_precedence_override_env_file_default(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "chunk_size: 128\ncache_policy: LFU\nlocal_cpu: false\nkernel_backend: torch\n",
    )
    env = {"KVTIER_CHUNK_SIZE": "64", "KVTIER_CACHE_POLICY": "FIFO", "KVTIER_LOCAL_CPU": "1"}
    overrides = {"chunk_size": 32, "config_file": str(path)}
    cfg = load_config(overrides=overrides, env=env)

    assert cfg.chunk_size == 32  # override beats env and file
    assert cfg.cache_policy == "FIFO"  # env beats file
    assert cfg.local_cpu is True  # env beats file
    assert cfg.kernel_backend == "torch"  # file beats default
    assert cfg.hash_algorithm == "sha256_cbor"  # default
    assert cfg.source_of("chunk_size") == "override"
    assert cfg.source_of("cache_policy") == "env var KVTIER_CACHE_POLICY"
    assert cfg.source_of("kernel_backend") == f"file {path}"
    assert cfg.source_of("hash_algorithm") == "default"


def test_config_file_argument(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 16\n")
    assert load_config(config_file=path, env={}).chunk_size == 16
    assert load_config(config_file=str(path), env={}).chunk_size == 16


def test_config_file_in_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 16\n")
    cfg = load_config(overrides={"config_file": str(path)}, env={})
    assert cfg.chunk_size == 16
    assert "config_file" not in cfg.to_dict()


def test_config_file_from_env(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 16\n")
    cfg = load_config(env={"KVTIER_CONFIG_FILE": str(path)})
    assert cfg.chunk_size == 16
    assert cfg.source_of("chunk_size") == f"file {path}"
    # An empty KVTIER_CONFIG_FILE means no file.
    assert load_config(env={"KVTIER_CONFIG_FILE": ""}).chunk_size == 256


def test_config_file_choice_order(tmp_path: Path) -> None:
    from_argument = write(tmp_path, "chunk_size: 1\n", "argument.yaml")
    from_overrides = write(tmp_path, "chunk_size: 2\n", "overrides.yaml")
    from_env = write(tmp_path, "chunk_size: 3\n", "env.yaml")
    env = {"KVTIER_CONFIG_FILE": str(from_env)}
    overrides = {"config_file": str(from_overrides)}
    assert load_config(overrides, config_file=from_argument, env=env).chunk_size == 1
    assert load_config(overrides, env=env).chunk_size == 2
    assert load_config(env=env).chunk_size == 3


def test_config_file_of_wrong_type_in_overrides() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"config_file": 3}, env={})
    assert_one_problem_mentions(excinfo.value, "config_file", "3", "override", "file path")


def test_lmcache_config_file_is_read_when_kvtier_names_no_file(tmp_path: Path) -> None:
    path = write(tmp_path, LMCACHE_YAML, "lmcache.yaml")
    cfg = load_config(env={"LMCACHE_CONFIG_FILE": str(path), "KVTIER_CACHE_POLICY": "FIFO"})
    assert (cfg.chunk_size, cfg.max_local_cpu_size, cfg.save_unfull_chunk) == (512, 20.0, True)
    assert cfg.cache_policy == "FIFO"  # KVTIER_* variables beat the file, as for any file
    assert cfg.source_of("chunk_size") == f"LMCACHE_CONFIG_FILE file {path}"
    origin = f"LMCACHE_CONFIG_FILE file {path} (as max_local_cache_size)"
    assert cfg.source_of("max_local_cpu_size") == origin
    assert "lmcache_instance_id" in cfg.ignored_lmcache_keys
    rows = {line.split()[0]: line for line in cfg.describe().splitlines()}
    assert rows["max_local_cpu_size"].endswith(origin)  # what `kvtier info` shows
    # An empty LMCACHE_CONFIG_FILE means no file.
    assert load_config(env={"LMCACHE_CONFIG_FILE": ""}) == KVTierConfig()


def test_lmcache_config_file_from_os_environ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "chunk_size: 64\n", "lmcache.yaml")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    assert load_config().chunk_size == 64
    assert KVTierConfig.from_dict({}).chunk_size == 256  # from_dict reads no environment


@pytest.mark.parametrize("given_as", ["KVTIER_CONFIG_FILE", "override", "argument"])
def test_kvtier_config_file_wins_over_lmcache_config_file_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, given_as: str
) -> None:
    ours = write(tmp_path, "chunk_size: 16\n", "kvtier.yaml")
    theirs = write(tmp_path, "chunk_size: 512\nlocal_cpu: false\n", "lmcache.yaml")
    env = {"LMCACHE_CONFIG_FILE": str(theirs)}
    overrides, config_file = {}, None
    if given_as == "KVTIER_CONFIG_FILE":
        env["KVTIER_CONFIG_FILE"] = str(ours)
    elif given_as == "override":
        overrides = {"config_file": str(ours)}
    else:
        config_file = ours
    with caplog.at_level(logging.WARNING):
        cfg = load_config(overrides, config_file=config_file, env=env)
    assert (cfg.chunk_size, cfg.local_cpu) == (16, True)
    assert cfg.source_of("chunk_size") == f"file {ours}"
    warnings = [r.getMessage() for r in caplog.records if "LMCACHE_CONFIG_FILE" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"LMCACHE_CONFIG_FILE ({theirs}) is ignored in favour of" in warnings[0]
    assert str(ours) in warnings[0]
    if given_as == "KVTIER_CONFIG_FILE":
        assert "in favour of KVTIER_CONFIG_FILE" in warnings[0]


def test_no_warning_about_lmcache_config_file_when_it_is_used_or_absent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, "chunk_size: 16\n")
    with caplog.at_level(logging.WARNING):
        load_config(env={"LMCACHE_CONFIG_FILE": str(path)})
        load_config(env={"KVTIER_CONFIG_FILE": str(path), "LMCACHE_CONFIG_FILE": ""})
    assert not caplog.records


def test_lmcache_config_file_problems_name_the_variable(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as excinfo:
        load_config(env={"LMCACHE_CONFIG_FILE": str(missing)})
    assert_one_problem_mentions(excinfo.value, f"LMCACHE_CONFIG_FILE file {missing}", "exist")
    path = write(tmp_path, "enable_pd: true\nchunk_sise: 8\n", "lmcache.yaml")
    with pytest.raises(ConfigError) as excinfo:
        load_config(env={"LMCACHE_CONFIG_FILE": str(path)})
    problems = problems_of(excinfo)
    assert len(problems) == 2, problems
    assert all(f"LMCACHE_CONFIG_FILE file {path}" in p for p in problems), problems
    assert "PD disaggregation" in problems[0] and "did you mean 'chunk_size'" in problems[1]


def test_describe_reports_values_and_sources(tmp_path: Path) -> None:
    path = write(
        tmp_path, "max_local_cache_size: 2\nhash_algorithm: xxh3_128\npy_enable_gc: true\n"
    )
    cfg = load_config(
        overrides={"model_name": "llama"},
        config_file=path,
        env={"KVTIER_CHUNK_SIZE": "64"},
    )
    rows = {line.split()[0]: line for line in cfg.describe().splitlines()}
    assert rows["model_name"].split()[1:] == ["'llama'", "override"]
    assert rows["chunk_size"].split()[1:] == ["64", "env", "var", "KVTIER_CHUNK_SIZE"]
    assert rows["hash_algorithm"].endswith(f"file {path}")
    assert rows["max_local_cpu_size"].endswith(f"file {path} (as max_local_cache_size)")
    assert rows["pool_alignment"].split()[1:] == ["256", "default"]
    assert "ignored LMCache keys: py_enable_gc" in cfg.describe()


def test_source_of_a_directly_built_config() -> None:
    cfg = KVTierConfig(chunk_size=16)
    assert cfg.source_of("chunk_size") == "argument"
    assert cfg.source_of("local_cpu") == "default"
    with pytest.raises(KeyError):
        cfg.source_of("chunk_sise")


# --------------------------------------------------------------------------------------
# Environment variables
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("On", True),
        ("false", False), ("False", False), ("0", False), ("no", False), ("OFF", False),
        (" yes ", True),
    ],
)  # fmt: skip
def test_env_bools(text: str, expected: bool) -> None:
    assert load_config(env={"KVTIER_SAVE_UNFULL_CHUNK": text}).save_unfull_chunk is expected


def test_env_numbers_and_strings() -> None:
    cfg = load_config(
        env={
            "KVTIER_CHUNK_SIZE": "512",
            "KVTIER_MAX_LOCAL_CPU_SIZE": "2.5",
            "KVTIER_POOL_ALIGNMENT": " 64 ",
            "KVTIER_HASH_SEED": "42",
            "KVTIER_KERNEL_BACKEND": "Interpret",
            "KVTIER_MODEL_NAME": "meta-llama/Llama-3-8B",
        }
    )
    assert cfg.chunk_size == 512
    assert cfg.max_local_cpu_size == 2.5
    assert cfg.pool_alignment == 64
    assert cfg.hash_seed == "42"
    assert cfg.kernel_backend == "interpret"
    assert cfg.model_name == "meta-llama/Llama-3-8B"


def test_env_int_for_float_key() -> None:
    cfg = load_config(env={"KVTIER_MAX_LOCAL_CPU_SIZE": "8"})
    assert cfg.max_local_cpu_size == 8.0
    assert isinstance(cfg.max_local_cpu_size, float)


def test_env_empty_string_is_null_for_nullable_key() -> None:
    assert load_config(env={"KVTIER_MODEL_NAME": ""}).model_name is None


@pytest.mark.parametrize(
    ("var", "text", "allowed"),
    [
        ("KVTIER_LOCAL_CPU", "maybe", "true/false, 1/0, yes/no, on/off"),
        ("KVTIER_CHUNK_SIZE", "abc", "an integer from 1 to 1048576"),
        ("KVTIER_CHUNK_SIZE", "1.5", "an integer from 1 to 1048576"),
        ("KVTIER_CHUNK_SIZE", "0", "an integer from 1 to 1048576"),
        ("KVTIER_MAX_LOCAL_CPU_SIZE", "5GB", "a finite number > 0"),
        ("KVTIER_MAX_LOCAL_CPU_SIZE", "nan", "a finite number > 0"),
        ("KVTIER_CACHE_POLICY", "ARC", "one of LRU, LFU, FIFO, MRU"),
        ("KVTIER_CHUNK_SIZE", "", "an integer from 1 to 1048576"),
    ],
)
def test_env_bad_values_name_var_value_and_allowed(var: str, text: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(env={var: text})
    key = var.removeprefix("KVTIER_").lower()
    assert_one_problem_mentions(excinfo.value, key, repr(text), f"env var {var}", allowed)


def test_unknown_env_var_is_an_error_with_suggestion() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(env={"KVTIER_CHUNK_SISE": "16"})
    assert_one_problem_mentions(
        excinfo.value, "KVTIER_CHUNK_SISE", "did you mean 'KVTIER_CHUNK_SIZE'?"
    )


def test_reserved_and_foreign_env_vars_are_not_keys() -> None:
    assert {"KVTIER_CONFIG_FILE", "KVTIER_LOG_LEVEL"} <= RESERVED_ENV_VARS
    env = {
        "KVTIER_LOG_LEVEL": "debug",
        "KVTIER_CONFIG_FILE": "",
        "LMCACHE_CHUNK_SIZE": "16",  # LMCache's env vars are not read
        "kvtier_chunk_size": "16",  # names are case-sensitive
        "PATH": "/usr/bin",
    }
    assert load_config(env=env) == KVTierConfig()


@given(st.integers(min_value=1, max_value=1 << 20))
def test_env_int_round_trips(chunk_size: int) -> None:
    assert load_config(env={"KVTIER_CHUNK_SIZE": str(chunk_size)}).chunk_size == chunk_size


# --------------------------------------------------------------------------------------
# Types, ranges, choices
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "allowed", "got"),
    [
        ("chunk_size", True, "an integer from 1 to 1048576", "bool"),
        ("chunk_size", "256", "an integer from 1 to 1048576", "str"),
        ("chunk_size", 256.0, "an integer from 1 to 1048576", "float"),
        ("max_local_cpu_size", "5", "a finite number > 0", "str"),
        ("max_local_cpu_size", False, "a finite number > 0", "bool"),
        ("local_cpu", 1, "a boolean", "int"),
        ("local_cpu", "true", "a boolean", "str"),
        ("cache_policy", 3, "one of LRU, LFU, FIFO, MRU", "int"),
        ("hash_seed", True, "a string", "bool"),
        ("hash_seed", 1.5, "a string", "float"),
        ("model_name", 7, "a non-empty string, or null", "int"),
        ("chunk_size", None, "an integer from 1 to 1048576", "null"),
    ],
)
def test_wrong_types_name_key_value_and_allowed(
    key: str, value: object, allowed: str, got: str
) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={key: value}, env={})
    assert_one_problem_mentions(
        excinfo.value, f"{key}: {value!r} from override", allowed, f"(got {got})"
    )


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("chunk_size", 0, "an integer from 1 to 1048576"),
        ("chunk_size", -256, "an integer from 1 to 1048576"),
        ("chunk_size", (1 << 20) + 1, "an integer from 1 to 1048576"),
        ("max_local_cpu_size", 0, "a finite number > 0"),
        ("max_local_cpu_size", -1.0, "a finite number > 0"),
        ("max_local_cpu_size", float("inf"), "a finite number > 0"),
        ("pool_alignment", 0, "a power of two from 1 to 4096"),
        ("pool_alignment", 3, "a power of two from 1 to 4096"),
        ("pool_alignment", 8192, "a power of two from 1 to 4096"),
        ("model_name", "", "a non-empty string"),
    ],
)
def test_out_of_range(key: str, value: object, allowed: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={key: value}, env={})
    assert_one_problem_mentions(excinfo.value, key, repr(value), "override", allowed)


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("cache_policy", "ARC", "one of LRU, LFU, FIFO, MRU"),
        ("hash_algorithm", "md5", "one of sha256_cbor, xxh3_128"),
        ("kernel_backend", "cuda", "one of auto, triton, interpret, torch"),
    ],
)
def test_invalid_choice_names_allowed_values(key: str, value: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={key: value}, env={})
    assert_one_problem_mentions(excinfo.value, key, repr(value), allowed)


@pytest.mark.parametrize("spelling", ["lfu", "LFU", "Lfu", " lfu "])
def test_cache_policy_is_case_insensitive(spelling: str) -> None:
    assert load_config(overrides={"cache_policy": spelling}, env={}).cache_policy == "LFU"


def test_accepted_conversions() -> None:
    cfg = load_config(
        overrides={
            "max_local_cpu_size": 3,
            "hash_seed": 0,
            "kernel_backend": "TRITON",
            "hash_algorithm": "XXH3_128",
            "pool_alignment": 1,
            "model_name": None,
        },
        env={},
    )
    assert cfg.max_local_cpu_size == 3.0 and isinstance(cfg.max_local_cpu_size, float)
    assert cfg.hash_seed == "0"
    assert cfg.kernel_backend == "triton"
    assert cfg.hash_algorithm == "xxh3_128"
    assert cfg.pool_alignment == 1
    assert cfg.model_name is None


def test_yaml_values_are_strict(tmp_path: Path) -> None:
    path = write(tmp_path, 'chunk_size: "256"\nhash_seed: 1234\n')
    with pytest.raises(ConfigError) as excinfo:
        load_config(config_file=path, env={})
    assert_one_problem_mentions(excinfo.value, "chunk_size", "'256'", f"file {path}", "(got str)")


# --------------------------------------------------------------------------------------
# Unknown keys and collected errors
# --------------------------------------------------------------------------------------


def test_unknown_override_key_suggests_the_right_one() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"chunk_sise": 16}, env={})
    assert_one_problem_mentions(
        excinfo.value, "unknown key 'chunk_sise'", "override", "did you mean 'chunk_size'?"
    )


def test_unknown_file_key_suggests_over_lmcache_names_too(tmp_path: Path) -> None:
    path = write(tmp_path, "enable_blendin: false\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(config_file=path, env={})
    assert_one_problem_mentions(
        excinfo.value, "'enable_blendin'", f"file {path}", "did you mean 'enable_blending'?"
    )


def test_unknown_key_without_close_match_has_no_suggestion() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"zzzzzz": 1}, env={})
    assert "did you mean" not in excinfo.value.problems[0]


def test_lmcache_names_are_case_sensitive() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"Chunk_Size": 16}, env={})
    assert_one_problem_mentions(excinfo.value, "'Chunk_Size'", "did you mean 'chunk_size'?")


def test_all_problems_are_reported_together(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 0\nenable_pd: true\nkernel_backend: cuda\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(
            overrides={"chunk_sise": 1, "pool_alignment": 3},
            config_file=path,
            env={"KVTIER_LOCAL_CPU": "maybe", "KVTIER_BOGUS": "1"},
        )
    problems = problems_of(excinfo)
    assert len(problems) == 7, problems
    message = str(excinfo.value)
    assert message.startswith("invalid kvtier configuration (7 problems):")
    for fragment in [
        "chunk_size: 0",
        "'enable_pd'",
        "kernel_backend: 'cuda'",
        "chunk_sise",
        "pool_alignment: 3",
        "KVTIER_LOCAL_CPU",
        "KVTIER_BOGUS",
    ]:
        assert fragment in message
    assert isinstance(excinfo.value, ValueError)


def test_same_key_twice_under_two_names() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"max_local_cpu_size": 1, "max_local_cache_size": 2}, env={})
    assert_one_problem_mentions(excinfo.value, "max_local_cpu_size", "'max_local_cache_size'")


def test_non_string_key(tmp_path: Path) -> None:
    path = write(tmp_path, "1: 2\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(config_file=path, env={})
    assert_one_problem_mentions(excinfo.value, "key 1", str(path))


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as excinfo:
        load_config(config_file=path, env={})
    assert_one_problem_mentions(excinfo.value, str(path), "does not exist")


def test_missing_file_from_env_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as excinfo:
        load_config(env={"KVTIER_CONFIG_FILE": str(path)})
    assert_one_problem_mentions(excinfo.value, str(path))


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(config_file=tmp_path, env={})
    assert_one_problem_mentions(excinfo.value, str(tmp_path), "cannot be read")


def test_bad_yaml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: [256\nlocal_cpu: true\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(config_file=path, env={})
    assert_one_problem_mentions(excinfo.value, str(path), "not valid YAML")


@pytest.mark.parametrize("text", ["- chunk_size\n- 256\n", "just a string\n", "42\n"])
def test_non_mapping_yaml_names_the_file(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        load_config(config_file=path, env={})
    assert_one_problem_mentions(excinfo.value, str(path), "mapping")


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "# nothing here\n")
    assert load_config(config_file=path, env={}) == KVTierConfig()


def test_config_file_inside_a_file_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "config_file: other.yaml\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(config_file=path, env={})
    assert_one_problem_mentions(excinfo.value, "'config_file'", str(path))


def test_file_errors_are_collected_with_others(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"chunk_size": 0}, config_file=tmp_path / "nope.yaml", env={})
    assert len(problems_of(excinfo)) == 2


# --------------------------------------------------------------------------------------
# LMCache compatibility
# --------------------------------------------------------------------------------------


def test_lmcache_yaml_loads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, LMCACHE_YAML, "lmcache.yaml")
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(config_file=path, env={})
    assert cfg.chunk_size == 512
    assert cfg.local_cpu is True
    assert cfg.max_local_cpu_size == 20.0
    assert cfg.max_local_cpu_bytes == 20 * 2**30
    assert cfg.cache_policy == "LRU"
    assert cfg.save_unfull_chunk is True
    assert cfg.source_of("max_local_cpu_size") == f"file {path} (as max_local_cache_size)"

    assert cfg.local_disk is None and cfg.remote_url is None
    ignored = (
        "blocking_timeout_secs",
        "extra_config",
        "internal_api_server_enabled",
        "internal_api_server_port_start",
        "lmcache_instance_id",
        "numa_mode",
        "py_enable_gc",
    )
    assert cfg.ignored_lmcache_keys == ignored
    warnings = [r for r in caplog.records if r.name == "kvtier.config"]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert all(name in warnings[0].getMessage() for name in ignored)


def test_lmcache_keys_in_overrides(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(
            overrides={"max_local_cache_size": 1, "py_enable_gc": False, "enable_p2p": False},
            env={},
        )
    assert cfg.max_local_cpu_size == 1.0
    assert cfg.ignored_lmcache_keys == ("py_enable_gc",)
    assert len(caplog.records) == 1


def test_no_warning_without_ignored_keys(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        load_config(overrides={"enable_blending": False, "remote_url": None}, env={})
    assert caplog.records == []


def test_ignored_keys_from_several_sources_warn_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, "numa_mode: auto\npy_enable_gc: true\n")
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(overrides={"py_enable_gc": False}, config_file=path, env={})
    assert cfg.ignored_lmcache_keys == ("numa_mode", "py_enable_gc")
    assert len(caplog.records) == 1


@pytest.mark.parametrize(
    ("key", "value", "feature"),
    [
        ("blend_thresholds", [0.5], "CacheBlend"),
        ("enable_p2p", True, "P2P"),
        ("enable_controller", True, "controller"),
        ("enable_pd", True, "PD disaggregation"),
        ("pd_role", "sender", "PD disaggregation"),
        ("nixl_backends", ["UCX"], "NIXL"),
        ("nixl_peer_host", "10.0.0.1", "NIXL"),
        ("gds_path", "/mnt/gds", "GPUDirect Storage"),
        ("weka_path", "/mnt/weka", "Weka"),
        ("external_lookup_client", "mooncakestore://x", "external lookup"),
        ("blend_separator", "<sep>", "CacheBlend"),
        ("mp_port", 1234, "multi-process"),
    ],
)
def test_enabled_unsupported_lmcache_key_is_an_error(key: str, value: object, feature: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={key: value}, env={})
    assert_one_problem_mentions(
        excinfo.value, f"LMCache key '{key}' is not supported by kvtier", feature, repr(value)
    )
    assert "not supported yet" not in excinfo.value.problems[0]


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("local_disk", "file:///tmp/lmcache/", "/tmp/lmcache/"),
        ("local_disk", "/var/cache/kvtier", "/var/cache/kvtier"),
        ("local_disk", "", None),
        ("max_local_disk_size", 10, 10.0),
        ("remote_url", "redis://localhost:6379", "redis://localhost:6379"),
        ("remote_url", "s3://bucket/prefix", "s3://bucket/prefix"),
        ("remote_url", "fs:///mnt/shared", "fs:///mnt/shared"),
        ("remote_url", "", None),
        ("remote_serde", "NAIVE", "naive"),
        ("remote_serde", "cachegen", "cachegen"),
        ("min_retrieve_tokens", 256, 256),
    ],
)
def test_lmcache_tier_keys_are_real_keys(key: str, value: object, expected: object) -> None:
    config = load_config(overrides={key: value}, env={})
    assert getattr(config, key) == expected
    assert config.ignored_lmcache_keys == ()


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"remote_url": "mc://localhost:11211"}, ("remote_url", "'mc://localhost:11211'", "s3")),
        ({"remote_url": "localhost:6379"}, ("remote_url", "redis")),
        ({"remote_serde": "zstd"}, ("remote_serde", "naive", "cachegen")),
        ({"local_disk": "/tmp/x", "max_local_disk_size": 0}, ("max_local_disk_size", "local_disk")),
        ({"remote_timeout_ms": 0}, ("remote_timeout_ms", "600000")),
        ({"remote_ttl_secs": -1}, ("remote_ttl_secs", "> 0")),
    ],
)
def test_bad_tier_settings_are_named(overrides: dict, fragments: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides=overrides, env={})
    assert_one_problem_mentions(excinfo.value, *fragments)


def test_secrets_are_never_shown() -> None:
    config = load_config(
        overrides={
            "remote_url": "redis://user:hunter2@cache:6379/0",
            "remote_password": "hunter3",
            "s3_secret_access_key": "hunter4",
        },
        env={},
    )
    table = config.describe()
    assert "redis://user:***@cache:6379/0" in table
    assert not any(secret in table for secret in ("hunter2", "hunter3", "hunter4"))
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"remote_url": "http://user:hunter2@cache"}, env={})
    assert "hunter2" not in str(excinfo.value)


def test_summary_names_changed_keys_only() -> None:
    assert KVTierConfig().summary() == "defaults"
    config = load_config(
        overrides={"chunk_size": 512, "remote_url": "redis://u:pw@h:1/0", "remote_password": "x"},
        env={},
    )
    assert config.summary() == (
        "chunk_size=512, remote_url='redis://u:***@h:1/0', remote_password='***'"
    )


def test_lmcache_disk_and_timeout_knobs_are_ignored() -> None:
    config = load_config(
        overrides={"blocking_timeout_secs": 30, "local_disk_path_sharding": "by_gpu"}, env={}
    )
    assert config.ignored_lmcache_keys == ("blocking_timeout_secs", "local_disk_path_sharding")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("enable_blending", False),
        ("blend_check_layers", []),
        ("blend_special_str", " # # "),
        ("blend_special_str", ""),
        ("pd_role", None),
        ("pd_buffer_size", 0),
        ("remote_serde", "naive"),
        ("remote_url", ""),
        ("max_local_disk_size", 0.0),
        ("blocking_timeout_secs", 10),
        ("use_gds", True),
        ("nixl_enable_gc", True),
        ("nixl_buffer_device", None),
        ("extra_config", {}),
    ],
)
def test_switched_off_lmcache_keys_are_accepted(key: str, value: object) -> None:
    assert load_config(overrides={key: value}, env={}).chunk_size == 256


@pytest.mark.parametrize(
    ("key", "value"),
    [("use_layerwise", True), ("save_decode_cache", True), ("enable_async_loading", True)],
)
def test_lmcache_connector_mode_keys_are_real_keys(key: str, value: object) -> None:
    config = load_config(overrides={key: value}, env={})
    assert getattr(config, key) is value
    assert config.ignored_lmcache_keys == ()


def test_lookup_timeout_is_validated() -> None:
    assert load_config(overrides={"lookup_timeout_ms": 50}, env={}).lookup_timeout_ms == 50
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"lookup_timeout_ms": 0}, env={})
    assert_one_problem_mentions(excinfo.value, "lookup_timeout_ms", "600000")


def test_switched_off_compares_bools_to_bools() -> None:
    assert not is_switched_off(True, 1)  # True == 1, but true is not an LMCache default of 1
    assert not is_switched_off(1, True)
    assert is_switched_off(True, True)
    assert is_switched_off(0.0, 5.0)
    assert not is_switched_off([0], None)


def test_lmcache_tables_are_disjoint_and_cover_aliases() -> None:
    tables = [
        set(CONFIG_KEYS),
        set(LMCACHE_ALIASES),
        set(LMCACHE_NO_EFFECT_KEYS),
        set(LMCACHE_UNSUPPORTED_KEYS),
        set(LMCACHE_PLANNED_KEYS),
    ]
    for i, first in enumerate(tables):
        for second in tables[i + 1 :]:
            assert not first & second, first & second
    assert LMCACHE_ALIASES == {
        "max_local_cache_size": "max_local_cpu_size",
        "blend_recompute_ratio": "blend_recompute_ratios",
    }


# --------------------------------------------------------------------------------------
# Round trips and docs
# --------------------------------------------------------------------------------------


def test_to_dict_round_trips(tmp_path: Path) -> None:
    path = write(tmp_path, "cache_policy: mru\nhash_seed: 7\nmodel_name: m\n")
    cfg = load_config(
        overrides={"chunk_size": 64}, config_file=path, env={"KVTIER_LOCAL_CPU": "off"}
    )
    as_dict = cfg.to_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert set(as_dict) == set(CONFIG_KEYS)
    assert load_config(overrides=as_dict, env={}) == cfg
    assert KVTierConfig.from_dict(as_dict) == cfg
    assert KVTierConfig(**as_dict) == cfg


def test_from_dict_accepts_lmcache_names_and_ignores_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_CHUNK_SIZE", "8")
    cfg = KVTierConfig.from_dict({"max_local_cache_size": 4, "numa_mode": None})
    assert cfg.chunk_size == 256
    assert cfg.max_local_cpu_size == 4.0
    assert cfg.ignored_lmcache_keys == ("numa_mode",)


def test_docs_are_in_sync_with_the_registry() -> None:
    doc = DOC.read_text()
    for name, make in config_docs.GENERATORS.items():
        block = config_docs.generated_block(doc, name)
        assert block is not None, f"docs/configuration.md has no generated block {name!r}"
        assert block == make(), "regenerate with: python -m kvtier.config_docs"


def test_docs_generator_rewrites_only_the_generated_blocks(tmp_path: Path) -> None:
    stale = re.sub(r"\| `chunk_size` \|[^\n]*\n", "", DOC.read_text(), count=1)
    path = write(tmp_path, stale, name="configuration.md")
    assert config_docs.main([str(path)]) == 0
    assert path.read_text() == DOC.read_text()
    with pytest.raises(ValueError, match="config_reference_markdown"):
        config_docs.regenerate("no blocks here")


def test_tuning_dir_goes_first_on_the_kernels_tuning_search_path(tmp_path: Path) -> None:
    from kvtier.engine import CacheEngine, EngineMetadata
    from kvtier.gpu_connector import use_tuning_dir
    from kvtier_kernels.tuning import lookup as tuning_lookup

    env_dir, config_dir = tmp_path / "env", tmp_path / "config"
    env = {"KVTIER_TUNING_DIR": str(env_dir)}  # the kernels' own variable, not a config key
    assert load_config(env=env).tuning_dir is None
    cfg = load_config({"tuning_dir": str(config_dir), "max_local_cpu_size": 0.01}, env=env)
    assert cfg.tuning_dir == str(config_dir)
    before = tuning_lookup.search_path()
    try:
        CacheEngine(cfg, EngineMetadata("m")).close()
        assert tuning_lookup.search_path() == before  # an engine leaves the process alone
        use_tuning_dir(cfg.tuning_dir)  # what the vLLM worker and the CLI do
        path = tuning_lookup.search_path()
        assert path[0] == config_dir
        assert path[-1] == tuning_lookup.PACKAGED_DIR
        use_tuning_dir(cfg.tuning_dir)  # applying it again changes nothing
        assert tuning_lookup.search_path() == path
    finally:
        tuning_lookup.set_search_path(None)
    with pytest.raises(ConfigError, match="tuning_dir"):
        load_config({"tuning_dir": ""}, env={})


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", ""), ("8", "8"), (8, "8"), ([16, 8, 8], "16,8,8"), ("16, 8", "16,8"), ("127", "127")],
)
def test_cachegen_levels_accept_one_int_or_one_per_layer(value: object, expected: str) -> None:
    assert load_config({"cachegen_k_levels": value}, env={}).cachegen_k_levels == expected
    assert load_config(env={"KVTIER_CACHEGEN_V_LEVELS": expected}).cachegen_v_levels == expected


@pytest.mark.parametrize("value", ["0", "128", "8,", "8,x", "-1", [8, True], 8.5, True])
def test_cachegen_levels_reject_what_is_not_a_schedule(value: object) -> None:
    with pytest.raises(ConfigError, match=r"cachegen_k_levels.*integers from 1 to 127"):
        load_config({"cachegen_k_levels": value}, env={})


def test_a_cachegen_schedule_is_per_layer_or_for_all() -> None:
    assert parse_levels("", 4, "cachegen_k_levels") is None
    assert parse_levels("8", 3, "cachegen_k_levels") == [8, 8, 8]
    assert parse_levels("16,8,4", 3, "cachegen_k_levels") == [16, 8, 4]
    with pytest.raises(ValueError, match="cachegen_v_levels lists 3 layers, the model has 2"):
        parse_levels("16,8,4", 2, "cachegen_v_levels")


def test_lmcache_pd_keys_point_to_kvtiers_roles() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"enable_pd": True}, env={})
    assert_one_problem_mentions(excinfo.value, "kv_role", "kv_producer", "disaggregated.md")


def test_blend_keys_take_lmcache_spellings() -> None:
    config = load_config(
        overrides={
            "enable_blending": True,
            "blend_recompute_ratio": 0.3,
            "blend_check_layers": [1, 3],
            "blend_min_tokens": 16,
        },
        env={},
    )
    assert config.enable_blending
    assert config.blend_recompute_ratios == "0.3"
    assert config.blend_check_layers == "1,3"
    assert blend_schedule(config) == [(1, 0.3), (3, 0.3)]
    assert (
        load_config(
            overrides={"blend_recompute_ratios": [0.3, 0.1], "blend_check_layers": [0, 1]},
            env={},
        ).blend_recompute_ratios
        == "0.3,0.1"
    )
    assert load_config(overrides={"blend_check_layers": []}, env={}).blend_check_layers == "0"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"blend_recompute_ratios": 1.5}, "blend_recompute_ratios"),
        ({"blend_recompute_ratios": "a,b"}, "blend_recompute_ratios"),
        ({"blend_check_layers": -1}, "blend_check_layers"),
        ({"blend_check_layers": [3, 1]}, "increasing order"),
        (
            {"blend_check_layers": [0, 2], "blend_recompute_ratios": [0.3, 0.2, 0.1]},
            "one per check layer",
        ),
        ({"blend_check_layers": [0, 2], "blend_recompute_ratios": [0.1, 0.3]}, "must not increase"),
        ({"blend_min_tokens": 0}, "blend_min_tokens"),
    ],
)
def test_blend_key_problems(overrides: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides=overrides, env={})
    assert fragment in str(excinfo.value)
