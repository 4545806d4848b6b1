"""Helpers of the config tests: a realistic LMCache YAML, config files, problem assertions."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import ConfigError

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
