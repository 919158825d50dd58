"""``agentjet-client run``'s options are generated from ``RunConfig`` and ``SessionOptions``: each field with
help text is an option, its default written once (or the command line's own, where leaving it out means
something else), a switch on by default offered as its ``--no-`` side, and every option read from the
environment too."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer.main

from agentjet_client.cli import ENV_PREFIX, _from_options, app
from agentjet_client.run.config import RunConfig, SessionOptions, cli_default


def _run_params() -> dict[str, object]:
    command = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params}


def _parse(*args: str) -> dict[str, object]:
    command = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    return dict(command.make_context("run", list(args)).params)


def test_every_field_with_help_is_an_option_with_its_default_and_environment_variable():
    params = _run_params()
    for cls in (SessionOptions, RunConfig):
        for spec in dataclasses.fields(cls):
            if "help" not in spec.metadata:
                assert spec.name not in params and f"no_{spec.name}" not in params, spec.name
                continue
            negated = spec.default is True
            name = f"no_{spec.name}" if negated else spec.name
            param = params[name]
            flag = "--" + name.replace("_", "-")
            assert param.opts == [flag], (spec.name, param.opts)  # type: ignore[attr-defined]
            expected = False if negated else cli_default(spec)
            assert param.default == expected or (param.default in (None, ()) and expected in (None, [])), spec.name  # type: ignore[attr-defined]
            assert param.envvar == (spec.metadata["envvar"] or ENV_PREFIX + name.upper())  # type: ignore[attr-defined]
    # the command line's own options beside them
    assert {"log_level", "log_format", "api_key_file", "heartbeat_file"} <= set(params)


def test_options_become_the_config_and_the_session_options(tmp_path):
    given = _parse(
        "--code-dir", str(tmp_path), "--code-dir", str(tmp_path / "b"), "--server", "http://h:1", "--episodes", "64",
        "--no-shuffle", "--no-watch", "--dynamic-sampling", "--max-failure-rate", "0.5", "--eval-every", "3",
    )  # fmt: skip
    config = _from_options(RunConfig, {**given, "group_size": given["group_size"] or 0}, follow_group_size=True)
    assert config == RunConfig(
        episodes=64, group_size=0, shuffle=False, dynamic_sampling=True, max_failure_rate=0.5, eval_every=3,
        follow_group_size=True,
    )  # fmt: skip
    options = _from_options(SessionOptions, given)
    assert options.code_dir == [tmp_path, tmp_path / "b"] and options.server == ["http://h:1"]
    assert options.watch is False and options.isolate is True and options.spool_max == 100_000
    # left out: the command line's defaults, not the library's where they differ
    plain = _from_options(RunConfig, {**(given := _parse()), "group_size": given["group_size"] or 0})
    assert plain.max_failure_rate is None and plain.group_size == 0 and plain.concurrency == RunConfig().concurrency
    assert _from_options(SessionOptions, _parse()).code_dir == [] == SessionOptions().code_dir
    assert isinstance(SessionOptions(code_dir=[Path("x")]).code_dir[0], Path)


def test_an_option_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "EPISODES", "12")
    monkeypatch.setenv(ENV_PREFIX + "NO_ISOLATE", "1")
    given = _parse()
    assert given["episodes"] == 12 and given["no_isolate"] is True
