"""Tests for kvtier.config: the config object, parsing, errors, the keys of each concern, docs."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from pathlib import Path

import pytest
from support.config import assert_one_problem_mentions, problems_of, write

from kvtier.config import CONFIG_KEYS, ConfigError, KVTierConfig, load_config
from kvtier.config import docs as config_docs
from kvtier.config.blend import blend_schedule
from kvtier.config.tiers import parse_levels

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


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
        "verify_checksums": False,
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
        "server_peers": None,
        "server_peer_discovery": None,
        "s3_endpoint_url": None,
        "s3_addressing_style": None,
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
    # a valid size under one byte is a one-byte pool (no chunk fits), never zero bytes
    assert KVTierConfig(max_local_cpu_size=1e-12).max_local_cpu_bytes == 1


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
        ("server_peers", [], "a string, or null", "list"),
        ("server_peer_discovery", False, "a string, or null", "bool"),
        ("blend_special_str", {}, "a string (empty: the default)", "dict"),
        ("remote_url", 0, "a URL with scheme", "int"),
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


def test_a_bracketed_ipv6_metrics_host_is_the_address_the_endpoint_binds() -> None:
    # a socket cannot bind "[::1]": the scheduler would refuse it after the model loaded
    assert load_config({"metrics_host": "[::1]"}, env={}).metrics_host == "::1"
    assert load_config(env={"KVTIER_METRICS_HOST": "[::]"}).metrics_host == "::"
    assert load_config({"metrics_host": "::1"}, env={}).metrics_host == "::1"


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


@pytest.mark.parametrize(
    "name", ["KVTIER_CHUNK_SIZE", "LMCACHE_CHUNK_SIZE", "kvtier.chunk_size", "lmcache.chunk_size"]
)
def test_a_key_spelt_as_a_variable_or_with_a_prefix_suggests_the_key(name: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={name: 16}, env={})
    assert_one_problem_mentions(
        excinfo.value, f"unknown key {name!r}", "did you mean 'chunk_size'?"
    )


def test_an_unknown_lmcache_worker_key_suggests_the_lmcache_name() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"lmcache_worker_portz": 1}, env={})
    assert "did you mean 'lmcache_worker_port" in excinfo.value.problems[0]


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
# Keys of the tiers, the connector, the kernels and CacheBlend
# --------------------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis://h:bad", "bad port 'bad'"),
        ("redis://", "missing host"),
        ("unix://", "missing socket path"),
        ("s3://", "valid S3 bucket name"),
        ("fs://relative", "give an absolute path after fs://"),
        ("kvtier://h", "expected kvtier://host:port"),
        ("kvtier://h:0", "expected kvtier://host:port"),
        ("redis://h:0", "bad port '0'"),
        ("lm://h:1/x", "expected kvtier://host:port"),
    ],
)
def test_a_malformed_remote_url_is_refused_when_the_config_is_built(url: str, fragment: str):
    """Every entry point builds its config first: a URL no retry could mend is refused
    there, naming remote_url and where it came from, not opened as a remote down forever."""
    for build, origin in (
        (lambda: load_config(overrides={"remote_url": url}, env={}), "override"),
        (lambda: load_config(env={"KVTIER_REMOTE_URL": url}), "KVTIER_REMOTE_URL"),
        (lambda: KVTierConfig(remote_url=url), "KVTierConfig(...)"),
    ):
        with pytest.raises(ConfigError) as excinfo:
            build()
        assert_one_problem_mentions(excinfo.value, origin, "remote_url", fragment)


@pytest.mark.parametrize(
    "endpoint",
    [
        *("minio:9000", "localhost:9000", "ftp://h:9", "http://", "http://h:port", "http://h:0"),
        *("http://h:9000?x=1", " http://h:9000", "http://u:hunter2@h:9000"),
    ],
)
def test_a_malformed_s3_endpoint_is_refused_when_the_config_is_built(endpoint: str) -> None:
    """boto3 refuses some of these only when the tier opens, naming no key; others make a
    remote that is down forever."""
    for build, origin in (
        (lambda: load_config(overrides={"s3_endpoint_url": endpoint}, env={}), "override"),
        (lambda: load_config(env={"KVTIER_S3_ENDPOINT_URL": endpoint}), "KVTIER_S3_ENDPOINT"),
    ):
        with pytest.raises(ConfigError) as excinfo:
            build()
        assert_one_problem_mentions(excinfo.value, origin, "s3_endpoint_url", "http://host")
        assert "hunter2" not in str(excinfo.value)


@pytest.mark.parametrize(
    "endpoint", ["http://minio:9000", "https://s3.example.com/base/", "http://[::1]:9000"]
)
def test_s3_endpoints(endpoint: str) -> None:
    assert load_config(overrides={"s3_endpoint_url": endpoint}, env={}).s3_endpoint_url == endpoint


def test_s3_addressing_style() -> None:
    assert load_config(env={}).s3_addressing_style is None
    config = load_config(env={"KVTIER_S3_ADDRESSING_STYLE": "Path"})
    assert config.s3_addressing_style == "path"
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"s3_addressing_style": "dns"}, env={})
    assert_one_problem_mentions(excinfo.value, "s3_addressing_style", "path", "virtual")


@pytest.mark.parametrize(
    "url", ["redis://u:hunter2@h:bad", "kvtier://u:hunter2@h", "fs://u:hunter2@h"]
)
def test_a_malformed_remote_url_is_refused_without_its_password(url: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"remote_url": url}, env={})
    assert "hunter2" not in str(excinfo.value)
    assert_one_problem_mentions(excinfo.value, "remote_url", "u:***@h")


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


@pytest.mark.parametrize(
    ("key", "empty"),
    [("server_token", None), ("server_peers", None), ("blend_special_str", " # # ")],
)
def test_only_an_empty_string_stands_for_an_unset_string_key(key: str, empty: object) -> None:
    assert getattr(load_config(overrides={key: ""}, env={}), key) == empty
    for value in ([], {}, 0, False):
        with pytest.raises(ConfigError) as excinfo:
            load_config(overrides={key: value}, env={})
        assert_one_problem_mentions(excinfo.value, f"{key}: ", f"(got {type(value).__name__})")


def test_summary_names_changed_keys_only() -> None:
    assert KVTierConfig().summary() == "defaults"
    config = load_config(
        overrides={"chunk_size": 512, "remote_url": "redis://u:pw@h:1/0", "remote_password": "x"},
        env={},
    )
    assert config.summary() == (
        "chunk_size=512, remote_url='redis://u:***@h:1/0', remote_password='***'"
    )


def test_lookup_timeout_is_validated() -> None:
    assert load_config(overrides={"lookup_timeout_ms": 50}, env={}).lookup_timeout_ms == 50
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"lookup_timeout_ms": 0}, env={})
    assert_one_problem_mentions(excinfo.value, "lookup_timeout_ms", "600000")


def test_tuning_dir_goes_first_on_the_kernels_tuning_search_path(tmp_path: Path) -> None:
    from kvtier.engine import CacheEngine, EngineMetadata
    from kvtier.paged_io import use_tuning_dir
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
        use_tuning_dir(cfg.tuning_dir)  # what the vLLM worker does
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


@pytest.mark.parametrize(
    "value", ["0", "128", "8,", "8,x", "-1", [8, True], 8.5, True, "\u00b2", "8,\u00b9\u2076"]
)
def test_cachegen_levels_reject_what_is_not_a_schedule(value: object) -> None:
    with pytest.raises(ConfigError, match=r"cachegen_k_levels.*integers from 1 to 127"):
        load_config({"cachegen_k_levels": value}, env={})


def test_a_cachegen_schedule_is_per_layer_or_for_all() -> None:
    assert parse_levels("", 4, "cachegen_k_levels") is None
    assert parse_levels("8", 3, "cachegen_k_levels") == [8, 8, 8]
    assert parse_levels("16,8,4", 3, "cachegen_k_levels") == [16, 8, 4]
    with pytest.raises(ValueError, match="cachegen_v_levels lists 3 layers, the model has 2"):
        parse_levels("16,8,4", 2, "cachegen_v_levels")


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
        assert block == make(), "regenerate with: python -m kvtier.config.docs"


def test_docs_generator_rewrites_only_the_generated_blocks(tmp_path: Path) -> None:
    stale = re.sub(r"\| `chunk_size` \|[^\n]*\n", "", DOC.read_text(), count=1)
    path = write(tmp_path, stale, name="configuration.md")
    assert config_docs.main([str(path)]) == 0
    assert path.read_text() == DOC.read_text()
    with pytest.raises(ValueError, match="config_reference_markdown"):
        config_docs.regenerate("no blocks here")


def test_docs_generator_has_a_help_and_refuses_a_file_without_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert config_docs.main(["--help"]) == 0
    assert "default: docs/configuration.md" in capsys.readouterr().out
    assert not Path("--help").exists()
    path = write(tmp_path, "no blocks here", name="other.md")
    assert config_docs.main([str(path)]) == 2
    assert "no generated block" in capsys.readouterr().err
    assert path.read_text() == "no blocks here"
    assert config_docs.main([str(tmp_path / "missing.md")]) == 2
    assert "missing.md" in capsys.readouterr().err
