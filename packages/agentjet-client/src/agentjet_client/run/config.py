"""How a run goes (``RunConfig``: one frozen set of settings that the runner and its parts, rollouts,
group starts, admission and delivery, read) and what it plays where (``SessionOptions``: code dirs or an
environment, servers, spool, task source; ``run.session`` assembles a run from both). Each field made with
``option`` (its help text, its bounds) is also an option of ``agentjet-client run``, generated from it: the
default is written once, here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

UNSET: Any = object()  # no other default on the command line than the field's


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    min: float | None = None,
    max: float | None = None,
    envvar: str | None = None,
    panel: str = "How it runs",
    cli_default: Any = UNSET,
) -> Any:
    """A field that is an option of ``agentjet-client run``: ``default`` (or a factory: ``list``), its ``--help``
    text (a switch that is on by default is offered as its ``--no-`` side: the text says what that does), its
    flag name if not the field's, bounds, its panel in ``--help``, and ``cli_default`` where the command line
    means something else by leaving it out than a library user does (``--group-size``: the server's)."""
    meta = {"help": help, "flag": flag, "metavar": metavar, "min": min, "max": max, "envvar": envvar, "panel": panel}
    if cli_default is not UNSET:
        meta["cli_default"] = cli_default
    if default in (list, dict):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class RunConfig:
    episodes: int = option(0, "episodes to run in total (0 = until Ctrl-C)", min=0)
    group_size: int = option(
        8,
        "episodes per task (one GRPO group) [default: the server's group size]",
        min=1,
        cli_default=None,  # 0 in the config: the session takes the server's
    )
    concurrency: int = option(32, "episodes running at once", min=1)
    timeout: float = option(300.0, "seconds before an episode is abandoned", min=0.001)
    admission: bool = True
    poll_interval: float = 0.2
    seed: int | None = option(None, "seed for the task order")
    send_batch: int = 256
    backoff_max: float = 30.0  # seconds between resends while the server does not answer
    watch_interval: float = 1.0  # seconds between looks at the code dir (with a watcher)
    eval_every: int = option(
        0, "policy versions between evaluation rounds on the agent's eval_tasks (0 = none)", min=0, panel="Evaluation"
    )
    eval_episodes: int = option(0, "episodes per evaluation round (0 = one per eval task)", min=0, panel="Evaluation")
    eval_only: bool = False  # one evaluation round, no training episodes (``agentjet-client eval``)
    sync: bool = option(  # one batch at a time: roll out, wait for the step, repeat (see the runner)
        False, "synchronous baseline: roll out one batch, wait for the server's step, repeat"
    )
    # stop above this share of failed episodes (None: ``StopRule``'s default; 1.0, for library use: never)
    max_failure_rate: float | None = option(
        1.0,
        "stop the run when more than this share of its episodes failed [default: stop when every episode of the "
        "first group, or of the first 5% of the run, failed]",
        min=0.0,
        max=1.0,
        metavar="<share>",
        cli_default=None,
    )
    follow_group_size: bool = False  # new groups take the server's group size when an admin changes it
    epochs: int = option(0, "passes over the tasks, then the run ends (0 = no end)", min=0, panel="Tasks")
    repeats: int = option(1, "groups of each task per pass", min=1, panel="Tasks")
    shuffle: bool = option(True, "play the tasks in their order (by default each pass is shuffled)", panel="Tasks")
    dynamic_sampling: bool = option(
        False,
        "start fewer groups of tasks whose last groups all scored the same (no gradient in them)",
        panel="Tasks",
    )


DEFAULT_SERVER = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class SessionOptions:
    """What a run plays and where its episodes go (``RunConfig`` says how it goes); each field with help text
    is an option of ``agentjet-client run``."""

    code_dir: list[Path] = option(
        list,
        "directory with agent.py defining one @swarm_agent (repeatable: several task families in one run; an "
        "agentjet.toml there may name its own python interpreter)",
        metavar="<dir>",
        panel="What runs",
    )
    env: str | None = option(
        None,
        "instead of a code dir, an environment you have: gymnasium:ENV_ID (gymnasium:module:ID imports the module "
        "first) or openenv:URL, tasks from --tasks (default: seeds 0-99); or verifiers:MODULE, its dataset (the "
        "module from the working directory or an installed package)",
        metavar="<kind:where>",
        panel="What runs",
    )
    env_args: dict[str, Any] | None = option(
        None, "a JSON object of keyword arguments for a verifiers load_environment", metavar="<json>", panel="What runs"
    )
    server: list[str] = option(
        list,
        "AgentJet server base URL for every agent; NAME=URL (repeatable) sends agent NAME's calls to another "
        f"server [default: {DEFAULT_SERVER}]",
        metavar="<url>",
        panel="Servers",
    )
    api_key: str | None = option(None, "server API key", envvar="AGENTJET_API_KEY", panel="Servers")
    tasks: Path | None = option(
        None,
        "train on this task file instead of the agent's tasks: .jsonl, .json, .csv, .parquet, or a directory saved "
        "with datasets' save_to_disk",
        metavar="<path>",
        panel="Tasks",
    )
    split: str | None = option(
        None, "the split of a saved datasets directory to train on", metavar="<name>", panel="Tasks"
    )
    eval_tasks: str | None = option(
        None,
        "held-out tasks: a fraction of the tasks (0.1), another split of the same dataset (test), or a second file",
        metavar="<spec>",
        panel="Tasks",
    )
    spool_dir: Path | None = option(
        None, "durable outbox for finished trajectories (default: user data dir)", panel="Delivery"
    )
    spool_max: int = option(100_000, "spooled trajectories before new episodes wait", min=1, panel="Delivery")
    watch: bool = option(True, "no hot swap (by default new episodes run the code as it is edited)", panel="What runs")
    isolate: bool = option(
        True, "run sync agents in threads (by default in worker processes: a hung one is killed)", panel="What runs"
    )
    say: Callable[[str], None] = field(default=lambda message: None, compare=False)  # what the session tells


def cli_default(spec: Any) -> Any:
    """What ``agentjet-client run`` takes when an option of ``spec`` (a dataclass field) is left out."""
    if "cli_default" in spec.metadata:
        return spec.metadata["cli_default"]
    if spec.default is not MISSING:
        return spec.default
    return None  # a list: typer's None, the factory's empty list
