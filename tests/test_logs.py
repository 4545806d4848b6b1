"""``KVTIER_LOG_LEVEL``: the level of kvtier's loggers in every process kvtier runs in (the
vLLM connector's scheduler and workers, the SGLang backend, ``kvtier serve``, ``kvtier
proxy``, every command), and a bad value refused naming the variable."""

from __future__ import annotations

import logging

import pytest

from kvtier import logs
from kvtier.cli import main

KVTIER = logging.getLogger("kvtier")


@pytest.fixture(autouse=True)
def _kvtier_logger_restored(monkeypatch):
    """Each test starts with the kvtier logger as the process had it, and leaves it so."""
    monkeypatch.delenv(logs.LOG_LEVEL_ENV_VAR, raising=False)
    level, handlers = KVTIER.level, list(KVTIER.handlers)
    yield
    KVTIER.setLevel(level)
    KVTIER.handlers[:] = handlers


@pytest.mark.parametrize(
    ("value", "level"),
    [
        ("debug", logging.DEBUG),
        ("INFO", logging.INFO),
        (" Warning ", logging.WARNING),
        ("error", logging.ERROR),
        ("critical", logging.CRITICAL),
        ("", None),
    ],
)
def test_a_level_is_read_in_any_case_and_empty_is_unset(value, level):
    assert logs.env_log_level({logs.LOG_LEVEL_ENV_VAR: value}) == level
    assert logs.env_log_level({}) is None


@pytest.mark.parametrize("value", ["loud", "10", "warn", "notset"])
def test_a_bad_level_names_the_variable_and_the_levels(value):
    with pytest.raises(ValueError, match=f"KVTIER_LOG_LEVEL='{value}': not a log level") as error:
        logs.env_log_level({logs.LOG_LEVEL_ENV_VAR: value})
    assert "debug, info, warning, error, critical" in str(error.value)


@pytest.mark.parametrize(
    "argv",
    [["info", "--json"], ["serve", "--port", "99999"], ["kernels", "--json"]],
    ids=["info", "serve", "kernels"],
)
def test_every_command_sets_the_kvtier_logger_to_the_level(monkeypatch, capsys, argv):
    monkeypatch.setenv(logs.LOG_LEVEL_ENV_VAR, "debug")
    KVTIER.setLevel(logging.NOTSET)
    main(argv)
    capsys.readouterr()
    assert KVTIER.level == logging.DEBUG


def test_a_command_refuses_a_bad_level(monkeypatch, capsys):
    monkeypatch.setenv(logs.LOG_LEVEL_ENV_VAR, "loud")
    assert main(["info"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "kvtier info: KVTIER_LOG_LEVEL='loud': not a log level" in captured.err
    assert main(["--version"]) == 0, "--version reads no logging setting"


def test_the_engine_side_sets_the_level_with_or_without_a_handler(monkeypatch):
    """``show_kvtier_logs`` is what the vLLM connector's scheduler and every worker run
    first: INFO and a handler where the process has none, else the handlers untouched;
    ``KVTIER_LOG_LEVEL`` sets the level either way."""
    KVTIER.handlers[:] = []
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    KVTIER.setLevel(logging.NOTSET)
    logs.show_kvtier_logs()
    assert KVTIER.level == logging.INFO and len(KVTIER.handlers) == 1
    monkeypatch.setenv(logs.LOG_LEVEL_ENV_VAR, "error")
    logs.show_kvtier_logs()
    assert KVTIER.level == logging.ERROR and len(KVTIER.handlers) == 1
    monkeypatch.setenv(logs.LOG_LEVEL_ENV_VAR, "loud")
    with pytest.raises(ValueError, match="KVTIER_LOG_LEVEL"):
        logs.show_kvtier_logs()


@pytest.mark.parametrize(("flag", "level"), [(None, logging.DEBUG), ("warning", logging.WARNING)])
def test_the_proxys_log_level_flag_wins_over_the_variable(monkeypatch, flag, level):
    pytest.importorskip("aiohttp")
    import kvtier.proxy.serving

    async def serve(proxy, host, port, grace_s):
        return 0

    monkeypatch.setattr(kvtier.proxy.serving, "serve", serve)
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    monkeypatch.setenv(logs.LOG_LEVEL_ENV_VAR, "debug")
    argv = ["proxy", "--decode", "http://127.0.0.1:1", "--port", "0"]
    assert main([*argv, *(["--log-level", flag] if flag else [])]) == 0
    assert KVTIER.level == level
