"""``agentjet-client``: run an agent against a swarm server, or look at a server's state."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import sys
from inspect import Parameter, Signature
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, get_args, get_origin, get_type_hints

import typer
from rich.console import Console
from rich.markup import escape

from agentjet_client import tracing
from agentjet_client.errors import AgentJetError
from agentjet_client.finetune.dpo import dpo_command
from agentjet_client.finetune.sft import sft_command
from agentjet_client.gateway.command import gateway_command
from agentjet_client.logs import LogFormat, console_logging
from agentjet_client.research.cli import app as research_app
from agentjet_client.run.config import RunConfig, SessionOptions, cli_default

if TYPE_CHECKING:
    from agentjet_client.run.report import RunReport
    from agentjet_client.run.session import RunSession

ENV_PREFIX = "AGENTJET_CLIENT_"  # every option of run is also read from AGENTJET_CLIENT_<OPTION>
app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="AgentJet swarm client: run agents, push trajectories."
)
console = Console(soft_wrap=True)  # a line stays one line in a pipe or a log (grep-able)
err = Console(stderr=True, soft_wrap=True)  # an error stays one line
app.add_typer(research_app, name="research")


def _as_every_command(command: Any) -> Any:
    """``command`` failing as every other command does: ``error: ...`` on one line, exit code 2."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except AgentJetError as exc:
            _fail(str(exc))

    return wrapper


app.command(name="sft")(_as_every_command(sft_command))
app.command(name="dpo")(_as_every_command(dpo_command))
app.command(name="gateway")(_as_every_command(gateway_command))


def _say(message: str) -> None:
    console.print(f"[cyan]agentjet-client[/cyan] {escape(message)}")


def _fail(message: str) -> None:
    err.print(f"[red]error:[/red] {escape(message)}")  # messages quote [extras] and paths
    raise typer.Exit(code=2)


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        value = exc
    if not isinstance(value, dict):
        _fail(f"{flag} takes a JSON object, for example {flag} '{{\"difficulty\": 2}}' (got {text!r})")
    return dict(value)


RUN_EXTRAS = [  # run's options that are not the session's nor the config's: the command line's own
    ("log_level", str, "warning", "logging level", None),
    ("log_format", str, "text", "json: a JSON object per log line, with episode ids", "<text|json>"),
    ("api_key_file", Path | None, None, "file holding the server API key (a mounted secret)", "<file>"),
    ("heartbeat_file", Path | None, None, "touched every second while the run goes on (a health check)", "<file>"),
]


def _cli_type(annotation: Any) -> Any:
    """What typer parses a field's type as: a list as a repeatable option, a mapping as its JSON text."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    optional = len(args) < len(get_args(annotation))
    core = args[0] if optional and len(args) == 1 else annotation
    if get_origin(core) is list:
        return core | None
    if get_origin(core) is dict:
        return str | None
    return core | None if optional else core


def _run_option(spec: dataclasses.Field[Any], annotation: Any) -> Parameter:
    """A ``SessionOptions`` or ``RunConfig`` field as an option of ``run``: a switch on by default is offered
    as its ``--no-`` side (the name of the parameter then says so: ``no_watch``)."""
    meta = spec.metadata
    flag = meta["flag"] or spec.name.replace("_", "-")
    default, name, kind = cli_default(spec), spec.name, _cli_type(annotation)
    if kind is bool and default is True:
        flag, name, default = f"no-{flag}", f"no_{spec.name}", False
    bounds = {key: meta[key] for key in ("min", "max") if meta[key] is not None}
    option = typer.Option(
        f"--{flag}",
        help=meta["help"],
        metavar=meta["metavar"],
        envvar=meta["envvar"] or ENV_PREFIX + name.upper(),
        show_envvar=meta["envvar"] is not None,  # the rule for the others is said once, in the command's help
        rich_help_panel=meta["panel"],
        **bounds,
    )
    return Parameter(name, Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option])


def _run_signature() -> Signature:
    params = []
    for cls in (SessionOptions, RunConfig):
        hints = get_type_hints(cls)
        params += [_run_option(f, hints[f.name]) for f in dataclasses.fields(cls) if "help" in f.metadata]
    for name, kind, default, help_text, metavar in RUN_EXTRAS:
        option = typer.Option(
            help=help_text, metavar=metavar, envvar=ENV_PREFIX + name.upper(), show_envvar=False, rich_help_panel="Logs"
        )
        params.append(Parameter(name, Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option]))
    return Signature(params)


def _from_options(cls: Any, given: dict[str, Any], **fixed: Any) -> Any:
    """``cls`` (``SessionOptions`` or ``RunConfig``) from ``run``'s options (a ``--no-`` switch turned back)."""
    values: dict[str, Any] = {}
    for spec in dataclasses.fields(cls):
        if "help" not in spec.metadata:
            continue
        if f"no_{spec.name}" in given:
            values[spec.name] = not given[f"no_{spec.name}"]
        elif given[spec.name] is not None or spec.default is None or "cli_default" in spec.metadata:
            value = given[spec.name]  # None left out: the factory's empty list
            values[spec.name] = list(value) if isinstance(value, tuple) else value
    return cls(**{**values, **fixed})


@app.command()
def run(**given: Any) -> None:
    """Run the agent in CODE_DIR over its tasks and push every episode to the server.

    Example:
    agentjet-client run --code-dir examples/digits --episodes 26000

    With evaluation on held-out tasks every 5 policy versions (the server
    records those rewards by version and never trains them; the dashboard
    plots them):
    agentjet-client run --code-dir examples/digits --episodes 6400 \\
      --eval-every 5 --eval-episodes 32

    The synchronous baseline (rollout, then train, then rollout; one client
    per server):
    agentjet-client run --code-dir examples/digits --episodes 6400 --sync

    Every option is also read from the environment as AGENTJET_CLIENT_<OPTION>
    (--code-dir is AGENTJET_CLIENT_CODE_DIR; a repeatable option takes values
    separated by spaces): a container is configured by its environment alone.

    A team on two servers (the executor agent's model on its own server, the
    other agents' on the first):
    agentjet-client run --code-dir examples/planner_executor \\
      --server http://127.0.0.1:8001 --server executor=http://127.0.0.1:8002

    A cocktail of two task families (each agent's tag; the server's --mix
    sets their proportions):
    agentjet-client run --code-dir tasks/math --code-dir tasks/tools
    """
    if given["log_format"] not in ("text", "json"):
        _fail(f"--log-format is text or json, not {given['log_format']!r}")
    env_args = given["env_args"]
    given["env_args"] = _json_object(env_args, "--env-args") if env_args is not None else None
    given["api_key"] = _api_key(given["api_key"], given["api_key_file"])
    # --group-size left out: 0, the server's (the session asks it)
    config = _from_options(RunConfig, {**given, "group_size": given["group_size"] or 0}, follow_group_size=True)
    options = _from_options(SessionOptions, given, say=_say)
    _run_agent(options, config, given["log_level"], given["log_format"], given["heartbeat_file"])


run.__signature__ = _run_signature()  # type: ignore[attr-defined]


def _api_key(key: str | None, key_file: Path | None) -> str | None:
    """The API key: given, or the first line of ``key_file`` (a mounted secret: not in ps, not in the environment)."""
    if key_file is None:
        return key
    if key is not None:
        _fail("give the API key one way: --api-key (AGENTJET_API_KEY) or --api-key-file, not both")
    try:
        lines = key_file.read_text().split()
    except OSError as exc:
        _fail(f"cannot read --api-key-file {key_file}: {exc.strerror}; mount the secret there or fix the path")
    if not lines:
        _fail(f"--api-key-file {key_file} is empty; write the key in it")
    return lines[0]


@app.command(name="try")
def try_agent(
    code_dir: Annotated[Path, typer.Option(help="directory with agent.py defining one @swarm_agent")],
    server: Annotated[str, typer.Option(help="AgentJet server base URL")] = "http://127.0.0.1:8000",
    task: Annotated[str | None, typer.Option(help="the id of the task to play (default: the first)")] = None,
    tasks: Annotated[
        Path | None,
        typer.Option(metavar="<path>", help="play a task of this file instead of the agent's tasks (as run --tasks)"),
    ] = None,
    split: Annotated[
        str | None, typer.Option(metavar="<name>", help="the split of a saved datasets directory to play from")
    ] = None,
    push: Annotated[bool, typer.Option(help="push the episode (as an evaluation episode: never trained)")] = False,
    api_key: Annotated[str | None, typer.Option(help="server API key", envvar="AGENTJET_API_KEY")] = None,
    timeout: Annotated[float, typer.Option(min=0.001, help="seconds before the episode is abandoned")] = 300.0,
    log_level: Annotated[str, typer.Option(help="logging level")] = "warning",
) -> None:
    """Play one episode and show it: each call's messages, answer, tool calls; then the reward.

    Nothing is pushed unless --push is given. Example:
    agentjet-client try --code-dir examples/first_task
    """
    console_logging(log_level, console)
    from agentjet_client.client import SwarmClient
    from agentjet_client.run.session import task_options, wait_until_serving
    from agentjet_client.run.tracks import open_track
    from agentjet_client.run.tryout import transcript, try_episode

    try:
        # in this process (its traceback shows where the agent failed), unless it needs its own interpreter
        track = open_track(code_dir, concurrency=1, isolate=(code_dir / "agentjet.toml").exists(), watch=False)
        track.task_options = task_options(tasks, split, None)
        with SwarmClient(server, api_key=api_key) as client:
            wait_until_serving(client, say=_say)
            tried = asyncio.run(try_episode(client, track, task, timeout, push))
    except (AgentJetError, ValueError) as exc:
        _fail(str(exc))
    finally:
        if "track" in locals() and track.workers is not None:
            track.workers.close()
    for line in transcript(tried):
        console.print(escape(line), highlight=False)
    if tried.failure is not None:
        raise typer.Exit(code=1)


@app.command(name="eval")
def evaluate(
    code_dir: Annotated[Path, typer.Option(help="directory with agent.py defining one @swarm_agent with eval_tasks")],
    server: Annotated[str, typer.Option(help="AgentJet server base URL")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option(help="server API key", envvar="AGENTJET_API_KEY")] = None,
    episodes: Annotated[int, typer.Option(min=0, help="evaluation episodes (0 = one per eval task)")] = 0,
    concurrency: Annotated[int, typer.Option(min=1, help="episodes running at once")] = 32,
    timeout: Annotated[float, typer.Option(min=0.001, help="seconds before an episode is abandoned")] = 300.0,
    spool_dir: Annotated[Path | None, typer.Option(help="durable outbox (default: user data dir)")] = None,
    log_level: Annotated[str, typer.Option(help="logging level")] = "warning",
) -> None:
    """Run one round of evaluation episodes on the agent's eval_tasks against the served policy.

    The server records each reward by the policy version that sampled it
    (dashboard, metrics.jsonl) and never trains them. Example:
    agentjet-client eval --code-dir examples/digits --episodes 64
    """
    config = RunConfig(concurrency=concurrency, timeout=timeout, eval_only=True, eval_episodes=episodes)
    options = SessionOptions(code_dir=[code_dir], server=[server], api_key=api_key, spool_dir=spool_dir, watch=False)
    _run_agent(dataclasses.replace(options, say=_say), config, log_level)


def _announce(session: RunSession) -> None:
    """What a run tells before its first episode: spooled trajectories it sets aside or sends first, and each
    agent with its code version, tag, interpreter and servers."""
    from agentjet_client.delivery.spool import SET_ASIDE

    spools, client = session.spools, session.runner.client
    for url, aside in session.set_aside.items():
        if aside:
            _say(
                f"set aside {aside} trajectories an earlier run left for another run of the server at {url} (sampled "
                f"by a policy it does not serve): they are in {spools[url].directory / SET_ASIDE}"
            )
    left = sum(spool.depth for spool in spools.values())
    if left:
        _say(f"{left} trajectories left by an earlier run are sent first")
    what = "evaluating" if session.config.eval_only else "agent"
    routes = client.server_url + "".join(f", {name} -> {url}" for name, url in client.agent_servers.items())
    for track in session.tracks:
        where = f" in {track.agent.python}" if track.remote else ""  # type: ignore[union-attr]
        tag = f" tag {track.tag}" if track.tag else ""
        console.print(
            f"[green]agentjet-client[/green] {what} [bold]{track.agent.name}[/bold] (code {track.code_version}{tag})"
            f"{where} -> {routes}"
        )


def _run_agent(
    options: SessionOptions,
    config: RunConfig,
    log_level: str,
    log_format: LogFormat = "text",
    heartbeat: Path | None = None,
) -> None:
    console_logging(log_level, console, log_format)
    tracing.configure("agentjet-client")  # with the OTEL_* variables: a trace per episode, over OTLP
    from agentjet_client.run import summary
    from agentjet_client.run.progress import RunProgress
    from agentjet_client.run.session import RunSession

    session = RunSession(options, config)

    def reloaded(new_version: str, error: str | None) -> None:
        if error is None:
            console.print(f"[cyan]agentjet-client[/cyan] code changed: new episodes run code {new_version}")
        else:
            err.print(f"[yellow]edit not loaded[/yellow] (still running code {new_version}): {escape(error)}")

    try:
        session.open(on_reload=reloaded)
    except (AgentJetError, ValueError) as exc:
        session.close()
        _fail(str(exc))
    config, spools, runner = session.config, session.spools, session.runner
    _announce(session)
    total = config.episodes
    if config.eval_only:
        total = config.eval_episodes or len(session.tracks[0].load_tasks(evaluation=True))

    async def main() -> RunReport:
        job = asyncio.create_task(runner.run())
        with RunProgress(console, total, lambda: summary.figures(runner.report, runner.unanswered)) as progress:
            while not job.done():
                progress.update(runner.report.evaluated if config.eval_only else runner.report.finished)
                if heartbeat is not None:
                    heartbeat.touch()
                await asyncio.wait({job}, timeout=1.0)
            progress.update(runner.report.evaluated if config.eval_only else runner.report.finished, force=True)
        return job.result()

    try:
        report = asyncio.run(main())
    except KeyboardInterrupt:
        report = runner.report
        waiting = {spool.directory: spool.depth for spool in spools.values() if spool.depth}
        err.print(
            "interrupted"
            + "".join(f"; {n} trajectories wait in {d} (the next run sends them first)" for d, n in waiting.items())
        )
    except AgentJetError as exc:  # e.g. tasks that fail to load in a later epoch: one clear error
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(code=2) from None
    except Exception:  # a bug of ours: its traceback (typer prints it) and exit 1, never a hang
        err.print(
            "[red]error:[/red] the run stopped on an unexpected error (traceback below); what finished is in "
            "the spool and the next run sends it first"
        )
        raise
    finally:
        session.close()
    for line in summary.summary(report, config):
        head, sep, rest = line.partition(":")
        bold = sep and head in ("done", "evaluation mean reward by policy version", "evaluation")
        console.print(f"[bold]{head}[/bold]{sep}{escape(rest)}" if bold else escape(line), highlight=False)
    failed = summary.verdict(report, config)
    if failed is not None:
        err.print(f"[red]error:[/red] {escape(failed)}")
        raise typer.Exit(code=3)


def server_status(
    server: Annotated[str, typer.Option(help="AgentJet server base URL")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option(help="server API key", envvar="AGENTJET_API_KEY")] = None,
) -> None:
    """Show a server's policy version, learner step, trajectory counts and admission budget.

    Example: agentjet-server status --server http://127.0.0.1:8000
    """
    from agentjet_client.client import SwarmClient

    try:
        with SwarmClient(server, api_key=api_key, attempts=1) as client:
            st = client.status()
    except (AgentJetError, ValueError) as exc:
        _fail(str(exc))
    console.print(f"server {server}: {st.summary()}")


@app.command()
def status(
    server: Annotated[str, typer.Option(help="AgentJet server base URL")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option(help="server API key", envvar="AGENTJET_API_KEY")] = None,
    spool_dir: Annotated[Path | None, typer.Option(help="the spool directory `run` used (default: data dir)")] = None,
) -> None:
    """Show this client's spool (depth, sent / accepted / duplicate / rejected, last error) and the server's state.

    Example:
    agentjet-client status --server http://127.0.0.1:8000
    """
    from agentjet_client.client import normalise_server_url
    from agentjet_client.delivery.spool import Spool
    from agentjet_client.run.session import spool_path

    path = spool_path(spool_dir, normalise_server_url(server))
    if (path / "spool.db").exists():
        spool = Spool(path)
        console.print(f"spool {path}: {spool.stats().summary()}")
        spool.close()
    else:
        console.print(f"spool {path}: empty (no run has spooled anything for this server)")
    server_status(server, api_key)


@app.command()
def mcp(
    root: Annotated[Path, typer.Option(help="the workspace: studies and files the tools may read and write")] = Path(),
    http: Annotated[bool, typer.Option(help="serve streamable HTTP (at /mcp) instead of stdio")] = False,
    host: Annotated[str, typer.Option(help="--http: the address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="--http: the port")] = 8765,
    allow_remote: Annotated[
        bool, typer.Option(help="--http on an address other machines reach (the tools have no authentication)")
    ] = False,
) -> None:
    """Serve a Model Context Protocol server for coding agents: list, start, stop and read studies,
    read a run's status, metrics and trajectories, change its live settings, pause and resume it.

    Examples (a coding agent's MCP configuration starts the first over stdio;
    the second serves http://127.0.0.1:8765/mcp):
    agentjet-client mcp --root runs
    agentjet-client mcp --root runs --http --port 8765
    """
    from agentjet_client.research.mcp_server import serve
    from agentjet_client.research.tools import ToolError

    if not root.is_dir():
        _fail(f"--root {root} is not a directory; give the folder your studies are in (or will be)")
    if http and host not in ("127.0.0.1", "localhost", "::1") and not allow_remote:
        _fail(
            f"--host {host}: the MCP tools start studies and steer runs with no authentication of their own; serve "
            "on 127.0.0.1 (reach it through an SSH tunnel), or pass --allow-remote on a network you trust"
        )
    try:
        serve(root, http, host, port)
    except ToolError as exc:
        _fail(str(exc))


def command() -> Any:
    """The CLI as a click command, with every option of ``run`` also read from the environment as
    ``AGENTJET_CLIENT_<OPTION>`` (``--code-dir`` is ``AGENTJET_CLIENT_CODE_DIR``; a repeatable option
    takes several values separated by spaces): a container is configured by its environment alone."""
    import typer.main

    group = typer.main.get_command(app)
    run_command = group.commands["run"]  # type: ignore[attr-defined]
    for param in run_command.params:
        if param.param_type_name == "option" and param.envvar is None:
            param.envvar = ENV_PREFIX + (param.name or "").upper()
            param.show_envvar = False  # the help says the rule once: the names do not fit an 80-column list
    return group


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM (an orchestrator stopping the pod) ends a run as Ctrl-C does


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, _terminated)
    try:
        command()(prog_name="agentjet-client")
    except KeyboardInterrupt:
        sys.exit(130)
