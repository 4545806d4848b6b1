"""Tests for kvtier.config's sources: precedence, the YAML file (kvtier's or LMCache's),
the ``KVTIER_*`` environment variables, and the record of where each value came from."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.config import LMCACHE_YAML, assert_one_problem_mentions, problems_of, write

from kvtier.config import ConfigError, KVTierConfig, load_config
from kvtier.config.sources import RESERVED_ENV_VARS

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
    # An empty or null config_file in the overrides names no file, as an empty variable.
    assert load_config({"config_file": ""}, env=env).chunk_size == 3
    assert load_config({"config_file": None}, env=env).chunk_size == 3
    assert load_config({"config_file": ""}, env={}).chunk_size == 256


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
        "LMCACHE_LOG_LEVEL": "debug",  # LMCache's variables that are not its keys
        "kvtier_chunk_size": "16",  # names are case-sensitive
        "PATH": "/usr/bin",
    }
    assert load_config(env=env) == KVTierConfig()


def test_a_bad_log_level_is_a_problem_of_the_config() -> None:
    # the connector's first hook in vLLM's engine core loads the config: a bad level is
    # reported there once, with the other problems, not by every worker afterwards
    with pytest.raises(ConfigError) as excinfo:
        load_config(env={"KVTIER_LOG_LEVEL": "loud", "KVTIER_CHUNK_SISE": "16"})
    problems = excinfo.value.problems
    assert len(problems) == 2
    assert "KVTIER_LOG_LEVEL='loud': not a log level" in problems[0]
    assert load_config(env={"KVTIER_LOG_LEVEL": " Warning "}) == KVTierConfig()


@given(st.integers(min_value=1, max_value=1 << 20))
def test_env_int_round_trips(chunk_size: int) -> None:
    assert load_config(env={"KVTIER_CHUNK_SIZE": str(chunk_size)}).chunk_size == chunk_size


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


def test_a_file_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_bytes(b"\xff\xfechunk_size: 256\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(config_file=path, env={})
    assert_one_problem_mentions(excinfo.value, str(path), "not UTF-8 text")


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
