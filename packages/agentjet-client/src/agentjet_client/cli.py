"""``agentjet-client``: run an agent against a swarm server, or look at a server's state."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from agentjet_client import tracing
from agentjet_client.errors import AgentJetError
from agentjet_client.logs import LogFormat, configure_logging, set_static_ids
from agentjet_client.preference import dpo_command
from agentjet_client.report import RunReport
from agentjet_client.research.cli import app as research_app
from agentjet_client.runconfig import RunConfig
from agentjet_client.supervised import sft_command

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="AgentJet swarm client: run agents, push trajectories."
)
console = Console(soft_wrap=True)  # a line stays one line in a pipe or a log (grep-able)
err = Console(stderr=True, soft_wrap=True)  # an error stays one line
app.add_typer(research_app, name="research")
app.command(name="sft")(sft_command)
app.command(name="dpo")(dpo_command)


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


def _logging(log_level: str, console: Console, log_format: LogFormat = "text") -> None:
    handler: logging.Handler | None = None
    if console.is_terminal and log_format == "text":  # log lines go above the live progress line, not through it
        from rich.logging import RichHandler

        handler = RichHandler(console=console, show_path=False, markup=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    configure_logging(log_level, log_format, handler)


@app.command()
def run(
    code_dir: Annotated[
        list[Path] | None,
        typer.Option(
            metavar="<dir>",
            help="directory with agent.py defining one @swarm_agent (repeatable: several task families in one "
            "run; an agentjet.toml there may name its own python interpreter)",
        ),
    ] = None,
    env: Annotated[
        str | None,
        typer.Option(
            metavar="<kind:where>",
            help="instead of a code dir, an environment you have: gymnasium:ENV_ID (gymnasium:module:ID imports "
            "the module first) or openenv:URL, tasks from --tasks (default: seeds 0-99); or verifiers:MODULE, its "
            "dataset (the module from the working directory or an installed package)",
        ),
    ] = None,
    env_args: Annotated[
        str | None,
        typer.Option(metavar="<json>", help="a JSON object of keyword arguments for a verifiers load_environment"),
    ] = None,
    server: Annotated[
        list[str] | None,
        typer.Option(
            metavar="<url>",
            help="AgentJet server base URL for every agent; NAME=URL (repeatable) sends agent NAME's calls to "
            "another server [default: http://127.0.0.1:8000]",
        ),
    ] = None,
    api_key: Annotated[str | None, typer.Option(help="server API key", envvar="AGENTJET_API_KEY")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="episodes running at once")] = 32,
    group_size: Annotated[
        int | None,
        typer.Option(min=1, help="episodes per task (one GRPO group) [default: the server's group size]"),
    ] = None,
    episodes: Annotated[int, typer.Option(min=0, help="episodes to run in total (0 = until Ctrl-C)")] = 0,
    timeout: Annotated[float, typer.Option(min=0.001, help="seconds before an episode is abandoned")] = 300.0,
    seed: Annotated[int | None, typer.Option(help="seed for the task order")] = None,
    tasks: Annotated[
        Path | None,
        typer.Option(
            metavar="<path>",
            help="train on this task file instead of the agent's tasks: .jsonl, .json, .csv, .parquet, or a "
            "directory saved with datasets' save_to_disk",
        ),
    ] = None,
    split: Annotated[
        str | None, typer.Option(metavar="<name>", help="the split of a saved datasets directory to train on")
    ] = None,
    eval_tasks: Annotated[
        str | None,
        typer.Option(
            metavar="<spec>",
            help="held-out tasks: a fraction of the tasks (0.1), another split of the same dataset (test), "
            "or a second file",
        ),
    ] = None,
    epochs: Annotated[int, typer.Option(min=0, help="passes over the tasks, then the run ends (0 = no end)")] = 0,
    repeats: Annotated[int, typer.Option(min=1, help="groups of each task per pass")] = 1,
    no_shuffle: Annotated[
        bool, typer.Option("--no-shuffle", help="play the tasks in their order (by default each pass is shuffled)")
    ] = False,
    dynamic_sampling: Annotated[
        bool,
        typer.Option(
            "--dynamic-sampling",
            help="start fewer groups of tasks whose last groups all scored the same (no gradient in them)",
        ),
    ] = False,
    spool_dir: Annotated[
        Path | None, typer.Option(help="durable outbox for finished trajectories (default: user data dir)")
    ] = None,
    spool_max: Annotated[int, typer.Option(min=1, help="spooled trajectories before new episodes wait")] = 100_000,
    no_watch: Annotated[
        bool, typer.Option("--no-watch", help="no hot swap (by default new episodes run the code as it is edited)")
    ] = False,
    no_isolate: Annotated[
        bool,
        typer.Option(
            "--no-isolate", help="run sync agents in threads (by default in worker processes: a hung one is killed)"
        ),
    ] = False,
    eval_every: Annotated[
        int,
        typer.Option(min=0, help="policy versions between evaluation rounds on the agent's eval_tasks (0 = none)"),
    ] = 0,
    eval_episodes: Annotated[
        int, typer.Option(min=0, help="episodes per evaluation round (0 = one per eval task)")
    ] = 0,
    sync: Annotated[
        bool,
        typer.Option("--sync", help="synchronous baseline: roll out one batch, wait for the server's step, repeat"),
    ] = False,
    max_failure_rate: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=1.0,
            metavar="<share>",
            help="stop the run when more than this share of its episodes failed [default: stop when every "
            "episode of the first group, or of the first 5% of the run, failed]",
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="logging level")] = "warning",
    log_format: Annotated[
        str, typer.Option(metavar="<text|json>", help="json: a JSON object per log line, with episode ids")
    ] = "text",
    api_key_file: Annotated[
        Path | None,
        typer.Option(metavar="<file>", help="file holding the server API key (a mounted secret)"),
    ] = None,
    heartbeat_file: Annotated[
        Path | None,
        typer.Option(metavar="<file>", help="touched every second while the run goes on (a health check)"),
    ] = None,
) -> None:
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

    A team on two servers (the executor agent's model on its own server, the
    other agents' on the first):
    agentjet-client run --code-dir examples/planner_executor \\
      --server http://127.0.0.1:8001 --server executor=http://127.0.0.1:8002

    A cocktail of two task families (each agent's tag; the server's --mix
    sets their proportions):
    agentjet-client run --code-dir tasks/math --code-dir tasks/tools
    """
    config = RunConfig(
        episodes=episodes,
        group_size=group_size or 0,  # 0: the server's (``_run_agent`` asks it)
        concurrency=concurrency,
        timeout=timeout,
        seed=seed,
        eval_every=eval_every,
        eval_episodes=eval_episodes,
        sync=sync,
        max_failure_rate=max_failure_rate,
        follow_group_size=True,
        epochs=epochs,
        repeats=repeats,
        shuffle=not no_shuffle,
        dynamic_sampling=dynamic_sampling,
    )
    if bool(code_dir) == (env is not None):
        _fail("give --code-dir (your agent) or --env (an environment you have), one of them")
    if log_format not in ("text", "json"):
        _fail(f"--log-format is text or json, not {log_format!r}")
    options = task_options(tasks, split, eval_tasks)
    _run_agent(
        code_dir or [],
        server or [],
        _api_key(api_key, api_key_file),
        config,
        spool_dir,
        spool_max,
        not no_watch,
        not no_isolate,
        log_level,
        options,
        env,
        _json_object(env_args, "--env-args") if env_args is not None else None,
        log_format=log_format,  # type: ignore[arg-type]
        heartbeat=heartbeat_file,
    )


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
    push: Annotated[bool, typer.Option(help="push the episode (as an evaluation episode: never trained)")] = False,
    api_key: Annotated[str | None, typer.Option(help="server API key", envvar="AGENTJET_API_KEY")] = None,
    timeout: Annotated[float, typer.Option(min=0.001, help="seconds before the episode is abandoned")] = 300.0,
    log_level: Annotated[str, typer.Option(help="logging level")] = "warning",
) -> None:
    """Play one episode and show it: each call's messages, answer, tool calls; then the reward.

    Nothing is pushed unless --push is given. Example:
    agentjet-client try --code-dir examples/first_task
    """
    _logging(log_level, console)
    from agentjet_client.client import SwarmClient, wait_until_serving
    from agentjet_client.tracks import open_track
    from agentjet_client.tryout import transcript, try_episode

    try:
        # in this process (its traceback shows where the agent failed), unless it needs its own interpreter
        track = open_track(code_dir, concurrency=1, isolate=(code_dir / "agentjet.toml").exists(), watch=False)
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
    _run_agent([code_dir], [server], api_key, config, spool_dir, 100_000, False, True, log_level)


def parse_servers(values: list[str]) -> tuple[str, dict[str, str]]:
    """``--server`` values: one plain URL (every agent's server; the default if none) and any
    number of ``NAME=URL`` (agent NAME's server)."""
    default: str | None = None
    agents: dict[str, str] = {}
    for value in values:
        name, sep, url = value.partition("=")
        if sep and "/" not in name and ":" not in name:  # NAME=URL (a URL's own '=' comes after its '://')
            if name in agents:
                raise ValueError(f"--server {value}: agent '{name}' already has a server ({agents[name]})")
            agents[name] = url
        elif default is not None:
            raise ValueError(
                f"--server {value}: the default server is already {default}; give other agents' servers as NAME=URL"
            )
        else:
            default = value
    return default or "http://127.0.0.1:8000", agents


def task_options(tasks: Path | None, split: str | None, eval_tasks: str | None) -> dict[str, Any]:
    """``run``'s own task source as ``TaskSpec`` fields; paths typed on the command line are read from
    the directory the command runs in."""
    from agentjet_client.tasksource import splits_of

    options: dict[str, Any] = {}
    if tasks is not None:
        options["tasks"] = tasks.expanduser().resolve()
    if split is not None:
        options["split"] = split
    if eval_tasks is not None:
        try:
            options["eval_tasks"] = float(eval_tasks)
        except ValueError:
            named = tasks is not None and eval_tasks in splits_of(options["tasks"])
            options["eval_tasks"] = eval_tasks if named else Path(eval_tasks).expanduser().resolve()
    return options


def _with_group_size(config: RunConfig, sizes: dict[str, int]) -> RunConfig:
    """``config`` with the servers' group size; a --group-size that differs from a server's is refused
    (its groups would wait out the server's --group-timeout before they train)."""
    wanted = config.group_size or next(iter(sizes.values()))
    for url, size in sizes.items():
        if size != wanted:
            given = f"--group-size {config.group_size}" if config.group_size else f"the first server's {wanted}"
            raise ValueError(
                f"{given} does not match the server at {url}, which trains groups of {size} (its --group-size); "
                "leave --group-size out to take the server's, or start the servers with the same --group-size"
            )
    return dataclasses.replace(config, group_size=wanted)


def _run_agent(
    code_dirs: list[Path],
    servers: list[str],
    api_key: str | None,
    config: RunConfig,
    spool_dir: Path | None,
    spool_max: int,
    watch: bool,
    isolate: bool,
    log_level: str,
    options: dict[str, Any] | None = None,
    env: str | None = None,
    env_args: dict[str, Any] | None = None,
    log_format: LogFormat = "text",
    heartbeat: Path | None = None,
) -> None:
    _logging(log_level, console, log_format)
    tracing.configure("agentjet-client")  # with the OTEL_* variables: a trace per episode, over OTLP
    from agentjet_client.client import SwarmClient, wait_until_serving
    from agentjet_client.progress import RunProgress
    from agentjet_client.runner import Runner
    from agentjet_client.spool import SET_ASIDE, open_for_run
    from agentjet_client.tracks import open_track

    try:
        if len(set(p.resolve() for p in code_dirs)) != len(code_dirs):
            raise ValueError("the same --code-dir is given twice")
        if config.sync and len(code_dirs) > 1:
            raise ValueError("--sync runs one code dir; give one --code-dir")
        default, agents = parse_servers(servers)
        client = SwarmClient(default, api_key=api_key, agents=agents)
        if config.sync and len(client.servers) > 1:
            raise ValueError("--sync drives one server; leave out the NAME=URL servers")
        tracks = [open_track(d, concurrency=config.concurrency, isolate=isolate, watch=watch) for d in code_dirs]
        if env is not None:
            from agentjet_client.envs import env_track

            tracks.append(env_track(env, env_args))
        if options:
            if len(tracks) > 1:
                raise ValueError("--tasks, --split and --eval-tasks give one code dir's tasks; give one --code-dir")
            tracks[0].task_options = options
        if config.eval_only or config.eval_every:  # no usable eval_tasks: say so now, not at the first round
            for track in [t for t in tracks if t.has_eval_tasks] or tracks[:1]:
                track.load_tasks(evaluation=True)
        tags = [t.tag for t in tracks]
        if len(tracks) > 1 and len(set(tags)) != len(tags):
            raise ValueError(
                f"the code dirs' agents share a task tag ({tags}); give each @swarm_agent(tag=...) its own tag "
                "so the server can keep their mix"
            )
        statuses = {url: wait_until_serving(client, url, say=_say) for url in client.servers}
        for url, status in statuses.items():
            if status.serve_only and not config.eval_only:
                raise ValueError(
                    f"the server at {url} only serves (started with --serve-only) and trains nothing: point run at "
                    "a training server (a --serve-only one is for judges and evaluation: agentjet-client eval)"
                )
        run_ids = {status.run_id for status in statuses.values() if status.run_id}
        if len(run_ids) == 1:  # --log-format json: the server's run on every line
            set_static_ids(run_id=run_ids.pop())
        sizes = {url: status.learner.group_size for url, status in statuses.items()}
        config = config if config.eval_only else _with_group_size(config, sizes)
        for track in tracks:  # tasks that fail to load say so now, with the agent's own frames
            track.load_tasks()
        spools = {}
        for url, status in statuses.items():
            spools[url], aside = open_for_run(_spool_path(spool_dir, url), status.run_id, max_items=spool_max)
            if aside:
                console.print(
                    f"[yellow]agentjet-client[/yellow] set aside {aside} trajectories an earlier run left for another "
                    f"run of the server at {url} (sampled by a policy it does not serve): they are in "
                    f"{spools[url].directory / SET_ASIDE}"
                )
    except (AgentJetError, ValueError) as exc:
        _fail(str(exc))
    left = sum(spool.depth for spool in spools.values())
    if left:
        console.print(f"[cyan]agentjet-client[/cyan] {left} trajectories left by an earlier run are sent first")
    what = "evaluating" if config.eval_only else "agent"
    routes = client.server_url + "".join(f", {name} -> {url}" for name, url in client.agent_servers.items())
    for track in tracks:
        where = f" in {track.agent.python}" if track.remote else ""  # type: ignore[union-attr]
        tag = f" tag {track.tag}" if track.tag else ""
        console.print(
            f"[green]agentjet-client[/green] {what} [bold]{track.agent.name}[/bold] (code {track.code_version}{tag})"
            f"{where} -> {routes}"
        )

    def reloaded(new_version: str, error: str | None) -> None:
        if error is None:
            console.print(f"[cyan]agentjet-client[/cyan] code changed: new episodes run code {new_version}")
        else:
            err.print(f"[yellow]edit not loaded[/yellow] (still running code {new_version}): {escape(error)}")

    runner = Runner(client, tracks, config, spools=spools, on_reload=reloaded)

    def figures() -> str:
        report = runner.report
        parts = []
        if report.rewards:
            parts.append(f"reward(64) {report.recent_mean(64):.3f}")
        if report.eval_rewards:
            at = max(report.eval_rewards)
            rewards = report.eval_rewards[at]
            parts.append(f"eval {sum(rewards) / len(rewards):.3f}@v{at}")
        parts.append(f"policy v{report.last_version if report.last_version is not None else '-'}")
        parts.append(f"accepted {report.accepted}  rejected {report.rejected}  failed {report.failed}")
        parts.append(f"spool {runner.unanswered}")
        return "  ".join(parts)

    if config.eval_only:
        total = config.eval_episodes or len(tracks[0].load_tasks(evaluation=True))
    else:
        total = config.episodes

    async def main() -> RunReport:
        job = asyncio.create_task(runner.run())
        with RunProgress(console, total, figures) as progress:
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
        client.close()
        for spool in spools.values():
            spool.close()
    _summary(report, config)
    _verdict(report, config)


def _verdict(report: RunReport, config: RunConfig) -> None:
    """Exit 3 when the run stopped because its episodes kept failing, or delivered nothing at all."""
    top = report.failure_reasons.most_common(1)
    cause = f"; most often: {top[0][1]} x {top[0][0]} (its traceback is above)" if top else ""
    if report.stopped is not None:
        err.print(f"[red]error:[/red] the run stopped: {escape(report.stopped)}{escape(cause)}")
        raise typer.Exit(code=3)
    if not config.eval_only and report.finished and not report.accepted:
        err.print(f"[red]error:[/red] no episode of this run was accepted by the server{escape(cause)}")
        raise typer.Exit(code=3)


def _version(version: int | None) -> str:
    return "-" if version is None else str(version)


def _mean(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def _summary(report: RunReport, config: RunConfig) -> None:
    if not config.eval_only:
        means = (
            f"mean reward first 10% {_mean(report.mean(0.0, 0.1))}  last 20% {_mean(report.mean(0.8, 1.0))}"
            if report.rewards
            else "no episode completed (mean reward -)"
        )
        console.print(
            f"[bold]done[/bold]: {report.finished} episodes in {report.elapsed_s:.0f}s  {means}  "
            f"policy v{_version(report.first_version)} -> "
            f"v{_version(report.last_version if report.last_version is not None else report.first_version)}  "
            f"accepted {report.accepted}  duplicate {report.duplicate}  rejected {report.rejected}  "
            f"failed {report.failed}"
        )
    for note in report.notes:
        console.print(escape(note))
    rates = report.tasks
    if rates.tasks and not config.eval_only:
        skipped = sum(rates.skipped.values())
        console.print(
            f"tasks: {len(rates.tasks)} played, {rates.tied_share:.0%} of their finished groups had equal rewards"
            + (f", {skipped} groups of tasks always or never solved passed over" if skipped else "")
        )
    judged = report.judging
    if judged:
        console.print(
            f"judge: {judged['calls']} calls ({judged['cached']} answered from the spool's kept answers), "
            f"{judged['errors']} failed and retried, {judged['prompt_tokens']} prompt + "
            f"{judged['completion_tokens']} completion tokens, {judged['milliseconds'] / 1000:.1f}s"
        )
    for line, count in report.failure_reasons.most_common(3):
        console.print(f"failed: {count} x {escape(line)}")
    if report.eval_rewards:
        rounds = "  ".join(f"v{v}: {sum(r) / len(r):.3f} ({len(r)})" for v, r in sorted(report.eval_rewards.items()))
        console.print(f"[bold]evaluation[/bold] mean reward by policy version: {rounds}")
    elif config.eval_only:
        console.print(f"[bold]evaluation[/bold]: no episode completed ({report.failed} failed)")
    if report.reloads or report.reload_errors:
        console.print(f"episodes per code version: {dict(report.code_versions)}")
    if report.resent_leftovers:
        console.print(f"delivered {report.resent_leftovers} trajectories an earlier run had left in the spool")
    if len(report.episodes_by_tag) > 1:
        for tag, started in sorted(report.episodes_by_tag.items()):
            rewards = report.tag_rewards.get(tag, [])
            mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
            console.print(f"tag {tag or '(none)'}: {started} episodes started, mean reward {mean}")
    if len(report.agent_rewards) > 1 or len(report.by_server) > 1:
        for name in sorted(report.agent_rewards):
            console.print(
                f"agent {name}: {report.turns_by_agent[name]} turns, mean reward first 10% "
                f"{_mean(report.mean(0.0, 0.1, name))}  last 20% {_mean(report.mean(0.8, 1.0, name))}"
            )
    if len(report.by_server) > 1:
        for url, counts in report.by_server.items():
            console.print(f"{url}: " + "  ".join(f"{k} {n}" for k, n in sorted(counts.items())))
    if report.reject_reasons:
        console.print(f"rejections: {dict(report.reject_reasons)}")


def _spool_path(spool_dir: Path | None, server_url: str) -> Path:
    from agentjet_client.spool import default_spool_dir, spool_key

    return (spool_dir or default_spool_dir()) / spool_key(server_url)


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
    from agentjet_client.spool import Spool

    path = _spool_path(spool_dir, normalise_server_url(server))
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


@app.command(name="gateway")
def gateway_command(
    server: Annotated[
        list[str] | None,
        typer.Option(
            metavar="<url>",
            help="the swarm server for every agent; NAME=URL (repeatable) sends agent NAME's calls to another "
            "[default: http://127.0.0.1:8000]",
        ),
    ] = None,
    api_key: Annotated[str | None, typer.Option(help="server API key", envvar="AGENTJET_API_KEY")] = None,
    host: Annotated[str, typer.Option(help="the address deployed agents reach the gateway at")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="the gateway's port")] = 8100,
    spool_dir: Annotated[
        Path | None,
        typer.Option(help="its journal and spools; a restart with the same folder goes on [default: data dir]"),
    ] = None,
    idle: Annotated[float, typer.Option(min=0.001, help="seconds without a call after which a session ends")] = 600.0,
    ttl: Annotated[
        float, typer.Option(min=0.001, help="seconds after its last call that a session waits for its reward")
    ] = 21600.0,
    fan_out: Annotated[
        int, typer.Option(min=0, help="sample a session's first call N times; the user gets the first")
    ] = 0,
    opt_in: Annotated[
        bool, typer.Option("--opt-in", help="train only sessions whose calls send X-AgentJet-Train: yes")
    ] = False,
    redact: Annotated[
        str | None,
        typer.Option(
            metavar="<module:function>",
            help="str -> str, applied to every text of a request before it leaves the gateway",
        ),
    ] = None,
    fallback: Annotated[
        str | None,
        typer.Option(metavar="<url>", help="an OpenAI base URL to answer from while the server is down"),
    ] = None,
    label: Annotated[
        list[str] | None,
        typer.Option(metavar="<name=reward>", help="a feedback label and its reward (repeatable)"),
    ] = None,
    group_by: Annotated[
        str,
        typer.Option(help="GRPO siblings: prompt (same first request), header (X-AgentJet-Group), session"),
    ] = "prompt",
    tag: Annotated[str | None, typer.Option(help="the task tag of its episodes (a multi-task mix)")] = None,
    judge_url: Annotated[
        str | None,
        typer.Option(metavar="<url>", help="an OpenAI base URL whose model rewards sessions without feedback"),
    ] = None,
    judge_model: Annotated[str | None, typer.Option(help="the judge's model name")] = None,
    judge_criteria: Annotated[
        str, typer.Option(help="what the judge rewards; @FILE reads it from a file")
    ] = "Score how well the assistant's final answer serves the user's request.",
    judge_after: Annotated[
        float, typer.Option(min=0.0, help="seconds an ended session waits for feedback before it is judged")
    ] = 60.0,
    log_level: Annotated[str, typer.Option(help="logging level")] = "warning",
) -> None:
    """Serve the server's API to deployed agents and train on their sessions.

    Point an agent's base_url at http://HOST:PORT/v1. Its calls are captured
    per session (X-AgentJet-Session header, or the request's user); POST
    /v1/feedback {"session": ID, "reward": R} trains it. See docs/online.md.
    Example:
    agentjet-client gateway --server http://127.0.0.1:8000 --port 8100
    """
    from agentjet_client.gateway.command import load_hook, make_judge, parse_labels
    from agentjet_client.gateway.service import Gateway, GatewayConfig
    from agentjet_client.spool import default_spool_dir

    _logging(log_level, err)
    try:
        default, agents = parse_servers(server or [])
        config = GatewayConfig(
            server=default,
            agents=agents,
            api_key=api_key,
            spool_dir=(spool_dir or default_spool_dir() / "gateway" / str(port)).expanduser(),
            idle_s=idle,
            ttl_s=ttl,
            fan_out=fan_out,
            opt_in=opt_in,
            redact=load_hook(redact) if redact else None,
            fallback=fallback,
            labels=parse_labels(label or []),
            group_by=group_by,
            task_tag=tag,
            judge=make_judge(judge_url, judge_model, judge_criteria),
            judge_after_s=judge_after,
        )
        made = Gateway(config, progress=lambda line: err.print(escape(line), highlight=False))
    except ValueError as exc:
        _fail(str(exc))
        return
    _say(
        f"gateway {made.book.gateway_id} on http://{host}:{port}/v1 -> {made.client.server_url}; "
        f"journal {made.journal.path}"
    )
    made.serve(host, port)


ENV_PREFIX = "AGENTJET_CLIENT_"


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
