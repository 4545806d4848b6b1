"""Tests for kvtier.config's LMCache compatibility: LMCache configs load, shared keys and
aliases are real keys, no-effect knobs are ignored with one warning, features kvtier
lacks are accepted only while switched off."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from support.config import LMCACHE_YAML, assert_one_problem_mentions, write

from kvtier.config import CONFIG_KEYS, LMCACHE_ALIASES, ConfigError, load_config
from kvtier.config.lmcache import (
    LMCACHE_NO_EFFECT_KEYS,
    LMCACHE_PLANNED_KEYS,
    LMCACHE_UNSUPPORTED_KEYS,
    is_switched_off,
)


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
        ("local_device", "file://local_disk/", "local_disk: PATH"),
        ("pd_retrieve_locations", ["PDBackend"], "PD disaggregation"),
    ],
)
def test_enabled_unsupported_lmcache_key_is_an_error(key: str, value: object, feature: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={key: value}, env={})
    assert_one_problem_mentions(
        excinfo.value, f"LMCache key '{key}' is not supported by kvtier", feature, repr(value)
    )
    assert "not supported yet" not in excinfo.value.problems[0]


def test_lmcache_p2p_keys_point_to_kvtier_serves_peers() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"enable_p2p": True}, env={})
    assert_one_problem_mentions(excinfo.value, "kvtier serve", "--peer", "server.md")


def test_lmcache_pd_keys_point_to_kvtiers_roles() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"enable_pd": True}, env={})
    assert_one_problem_mentions(excinfo.value, "kv_role", "kv_producer", "disaggregated.md")


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
        ("local_device", "cpu"),
        ("pipelined_backend", False),
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


def test_lmcache_variables_set_the_keys_lmcache_shares() -> None:
    env = {
        "LMCACHE_CHUNK_SIZE": "512",
        "LMCACHE_LOCAL_CPU": "False",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "20",
        "LMCACHE_REMOTE_URL": '"redis://localhost:6379"',
        "LMCACHE_ENABLE_BLENDING": "1",
        "LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.2",
    }
    cfg = load_config(env=env)
    assert (cfg.chunk_size, cfg.local_cpu, cfg.max_local_cpu_size) == (512, False, 20.0)
    assert cfg.remote_url == "redis://localhost:6379"
    assert cfg.enable_blending is True and cfg.blend_recompute_ratios == "0.2"
    assert cfg.source_of("chunk_size") == "env var LMCACHE_CHUNK_SIZE"


def test_lmcache_variables_beat_the_file_and_lose_to_kvtiers(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 64\nmax_local_cpu_size: 1\n", "lmcache.yaml")
    env = {
        "LMCACHE_CONFIG_FILE": str(path),
        "LMCACHE_CHUNK_SIZE": "512",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "2",
        "KVTIER_MAX_LOCAL_CPU_SIZE": "3",
    }
    cfg = load_config(env=env)
    assert (cfg.chunk_size, cfg.max_local_cpu_size) == (512, 3.0)
    cfg = load_config(overrides={"chunk_size": 16}, env=env)
    assert cfg.chunk_size == 16


def test_lmcache_variables_of_other_keys_follow_the_lmcache_rules(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {
        "LMCACHE_PY_ENABLE_GC": "True",
        "LMCACHE_ENABLE_PD": "False",
        "LMCACHE_MP_PORT": "5555",
        "LMCACHE_HASH_SEED": "not an LMCache key",
        "LMCACHE_LOG_LEVEL": "DEBUG",
        "LMCACHE_PD_WAIT_MS": "5000",  # kvtier's key, not LMCache's: left alone
    }
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(env=env)
    assert cfg.hash_seed == CONFIG_KEYS["hash_seed"].default
    assert cfg.ignored_lmcache_keys == ("py_enable_gc",)
    assert len(caplog.records) == 1
    with pytest.raises(ConfigError) as excinfo:
        load_config(env={"LMCACHE_ENABLE_PD": "true"})
    assert_one_problem_mentions(
        excinfo.value, "'enable_pd' is not supported", "env var LMCACHE_ENABLE_PD", "kv_role"
    )


@pytest.mark.parametrize("text", ["yes", "on", "no", ""])
def test_an_lmcache_boolean_variable_lmcache_would_read_otherwise_is_refused(text: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(env={"LMCACHE_LOCAL_CPU": text})
    assert_one_problem_mentions(excinfo.value, "LMCACHE_LOCAL_CPU", "true/1 or false/0")


def test_an_lmcache_key_set_by_two_variables_is_an_error() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(env={"LMCACHE_MAX_LOCAL_CPU_SIZE": "2", "LMCACHE_MAX_LOCAL_CACHE_SIZE": "3"})
    assert_one_problem_mentions(
        excinfo.value,
        "max_local_cpu_size",
        "LMCACHE_MAX_LOCAL_CACHE_SIZE",
        "LMCACHE_MAX_LOCAL_CPU_SIZE",
    )


@pytest.mark.parametrize(
    "url",
    [
        "s3://my-bucket.s3.us-east-1.amazonaws.com",
        "s3://kv.s3.eu-west-1.amazonaws.com/prefix",
        "s3://fakefile--use1-az4--x-s3.s3express-use1-az4.us-east-1.amazonaws.com",
    ],
)
def test_lmcaches_s3_endpoint_url_is_refused_not_read_as_a_bucket(url: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"remote_url": url}, env={})
    assert_one_problem_mentions(excinfo.value, "S3 endpoint host", "s3_region", "s3://")


def test_lmcaches_s3_url_of_another_service_names_the_endpoint_to_give() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"remote_url": "s3://kv-cache.t3.storage.dev"}, env={})
    assert_one_problem_mentions(
        excinfo.value, "s3://kv-cache[/prefix]", "s3_endpoint_url: https://t3.storage.dev"
    )
    assert load_config(overrides={"remote_url": "s3://logs.example.com"}, env={}).remote_url


@pytest.mark.parametrize(
    ("url", "backend"),
    [
        ("mooncakestore://127.0.0.1:50051", "Mooncake Store"),
        ("infinistore://127.0.0.1:12345?device=mlx5_0", "InfiniStore"),
        ("redis-sentinel://user:hunter2@s1:26379,s2:26379/mymaster", "Redis Sentinel"),
        ("blackhole://", "blackhole"),
    ],
)
def test_lmcaches_other_remote_backends_are_named_in_the_error(url: str, backend: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides={"remote_url": url}, env={})
    assert_one_problem_mentions(excinfo.value, "remote_url", f"LMCache's {backend}", "redis, ")
    assert "hunter2" not in str(excinfo.value)
