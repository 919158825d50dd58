"""A run's assembly: from what a user gives (code dirs or an environment, servers, a spool folder, a task
source) to a ``Runner`` ready to go, and its end. ``agentjet-client run`` and ``eval`` build one; a library
user can too::

    session = RunSession(SessionOptions(code_dir=[Path("examples/digits")]), RunConfig(episodes=640))
    session.open()  # checks everything it can before the first episode; raises what is wrong
    try:
        report = asyncio.run(session.runner.run())
    finally:
        session.close()  # the version the server trained to, the spools and the client closed

``open`` refuses what cannot work (a code dir given twice, ``--sync`` with several code dirs or servers,
a task tag shared by two code dirs, a ``--serve-only`` server for a training run, a group size that
differs from a server's) with a ``ValueError`` or an ``AgentJetError`` that says what to change.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentjet_client.client import SwarmClient
from agentjet_client.delivery.spool import Spool, default_spool_dir, open_for_run, spool_key
from agentjet_client.errors import AgentJetError, ServerError, ServerStarting, ServerUnreachable
from agentjet_client.logs import set_static_ids
from agentjet_client.protocol import STARTING_RETRY_S, ServerStatus
from agentjet_client.run.config import DEFAULT_SERVER, RunConfig, SessionOptions
from agentjet_client.run.report import RunReport
from agentjet_client.run.runner import Runner
from agentjet_client.run.tracks import Track, open_track


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
    return default or DEFAULT_SERVER, agents


def task_options(tasks: Path | None, split: str | None, eval_tasks: str | None) -> dict[str, Any]:
    """``run``'s own task source as ``TaskSpec`` fields; paths typed on the command line are read from
    the directory the command runs in."""
    from agentjet_client.tasks.sources import splits_of

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


def with_group_size(config: RunConfig, sizes: dict[str, int]) -> RunConfig:
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


def spool_path(spool_dir: Path | None, server_url: str) -> Path:
    """Where the spool for ``server_url`` lives: under ``spool_dir``, or the user data dir."""
    return (spool_dir or default_spool_dir()) / spool_key(server_url)


def version_now(client: SwarmClient) -> int | None:
    """The default server's policy version as the run ends: the last push's answer may predate the steps
    the learner took on this run's last batches (a short run: all pushed before the first step)."""
    try:
        return client.status(retry=False).policy_version
    except AgentJetError:  # the server is gone: the report keeps what the last answer said
        return None


def wait_until_serving(
    client: SwarmClient,
    server: str | None = None,
    say: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> ServerStatus:
    """The server's status once it serves: while it answers that it is still starting (building or
    loading its model) this waits, telling ``say`` what it does when that changes (at most every
    20 s). A server that cannot be reached raises as ``client.status`` does."""
    said, said_at = "", 0.0
    while True:
        try:
            return client.status(server, retry=False)
        except ServerStarting as exc:
            phase = exc.message.split(" (for ")[0]
            if say is not None and phase != said and time.monotonic() - said_at >= 20.0:
                say(exc.message)
                said, said_at = phase, time.monotonic()
            sleep(STARTING_RETRY_S)
        except (ServerUnreachable, ServerError):
            return client.status(server)


class RunSession:
    """One run, assembled: the client, the tracks, the spools, the runner; ``open`` first, ``close`` last."""

    def __init__(self, options: SessionOptions, config: RunConfig) -> None:
        self.options = options
        self.config = config
        self.client: SwarmClient | None = None
        self.tracks: list[Track] = []
        self.spools: dict[str, Spool] = {}
        self.set_aside: dict[str, int] = {}  # server -> trajectories an earlier run left for another run
        self._runner: Runner | None = None

    def open(self, on_reload: Callable[[str, str | None], None] | None = None) -> None:
        """Check what can be checked before the first episode (raising what is wrong), then build the runner."""
        options, config = self.options, self.config
        code_dirs = options.code_dir
        if bool(code_dirs) == (options.env is not None):
            raise ValueError("give --code-dir (your agent) or --env (an environment you have), one of them")
        if len(set(p.resolve() for p in code_dirs)) != len(code_dirs):
            raise ValueError("the same --code-dir is given twice")
        if config.sync and len(code_dirs) > 1:
            raise ValueError("--sync runs one code dir; give one --code-dir")
        default, agents = parse_servers(options.server)
        self.client = client = SwarmClient(default, api_key=options.api_key, agents=agents)
        if config.sync and len(client.servers) > 1:
            raise ValueError("--sync drives one server; leave out the NAME=URL servers")
        self.tracks = self._open_tracks()
        statuses = {url: wait_until_serving(client, url, say=options.say) for url in client.servers}
        self._check_servers(statuses)
        for track in self.tracks:  # tasks that fail to load say so now, with the agent's own frames
            track.load_tasks()
        for url, status in statuses.items():
            path = spool_path(options.spool_dir, url)
            self.spools[url], self.set_aside[url] = open_for_run(path, status.run_id, max_items=options.spool_max)
        self._runner = Runner(client, self.tracks, self.config, spools=self.spools, on_reload=on_reload)

    def _open_tracks(self) -> list[Track]:
        options, config = self.options, self.config
        tracks = [
            open_track(d, concurrency=config.concurrency, isolate=options.isolate, watch=options.watch)
            for d in options.code_dir
        ]
        if options.env is not None:
            from agentjet_client.envs import env_agent

            # an environment's agent, played in this process
            tracks.append(Track(env_agent(options.env, options.env_args), code_version=f"env:{options.env}"[:64]))
        given = task_options(options.tasks, options.split, options.eval_tasks)
        if given:
            if len(tracks) > 1:
                raise ValueError("--tasks, --split and --eval-tasks give one code dir's tasks; give one --code-dir")
            tracks[0].task_options = given
        if config.eval_only or config.eval_every:  # no usable eval_tasks: say so now, not at the first round
            for track in [t for t in tracks if t.has_eval_tasks] or tracks[:1]:
                track.load_tasks(evaluation=True)
        tags = [t.tag for t in tracks]
        if len(tracks) > 1 and len(set(tags)) != len(tags):
            raise ValueError(
                f"the code dirs' agents share a task tag ({tags}); give each @swarm_agent(tag=...) its own tag "
                "so the server can keep their mix"
            )
        return tracks

    def _check_servers(self, statuses: dict[str, ServerStatus]) -> None:
        config = self.config
        for url, status in statuses.items():
            if status.serve_only and not config.eval_only:
                raise ValueError(
                    f"the server at {url} only serves (started with --serve-only) and trains nothing: point run at "
                    "a training server (a --serve-only one is for judges and evaluation: agentjet-client eval)"
                )
        run_ids = {status.run_id for status in statuses.values() if status.run_id}
        if len(run_ids) == 1:  # --log-format json: the server's run on every line
            set_static_ids(run_id=run_ids.pop())
        if not config.eval_only:
            sizes = {url: status.learner.group_size for url, status in statuses.items()}
            self.config = with_group_size(config, sizes)

    @property
    def runner(self) -> Runner:
        if self._runner is None:
            raise RuntimeError("open the session first (RunSession.open)")
        return self._runner

    @property
    def report(self) -> RunReport:
        return self.runner.report

    def close(self) -> RunReport | None:
        """The server's version as the run ends into the report; the client and the spools closed."""
        report = self._runner.report if self._runner is not None else None
        if self.client is not None:
            if report is not None:
                report.final_version = version_now(self.client)
            self.client.close()
        for spool in self.spools.values():
            spool.close()
        for track in self.tracks:
            if track.workers is not None:
                track.workers.close()
        return report
