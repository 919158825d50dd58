"""A study: what ``agentjet-client research run STUDY.toml`` reads, and the trials it plans.

A study file is TOML with six tables (and ``[pbt]`` / ``[[adjust]]`` to change settings while trials
train: ``tuning.py``)::

    [study]                     # how the study searches and what it optimises
    name = "digits: lr x group size"
    search = "grid"             # grid (every combination), random (`trials` draws), halving
    metric = "eval_reward"      # mean reward of a final evaluation round; or train_reward
    parallel = "auto"           # trials at once: auto = what the machine holds (see `machine_parallel`)
    max_resumes = 2             # a crashed trial is resumed this many times, then marked failed
    total_minutes = 15          # trials not started by then are skipped; running ones are stopped

    [trial]                     # the budget of one trial
    episodes = 10000
    minutes = 4

    [server]                    # `agentjet-server up` options shared by every trial (a job file)
    batch_groups = 10

    [client]                    # the `agentjet-client run` every trial makes
    code_dir = "../digits"      # relative to the study file
    env = { AGENTJET_DIGITS = "3,8" }

    [space]                     # what is searched: server.* and client.* settings
    "server.lr" = [1e-3, 3e-3]
    "server.group_size" = [8, 16]
    "client.code_dir" = ["../digits", "../digits_v2"]   # agent code variants

    [stop]                      # early stopping (``stopping.py``)
    max_drop = 0.5

A random search draws each trial's settings from the space: a list is a choice, a table
``{ log_uniform = [1e-4, 1e-2] }``, ``{ uniform = [a, b] }`` or ``{ int_uniform = [a, b] }`` a
range. Successive halving (``search = "halving"``) starts every configuration of the grid (or
``trials`` random draws) on ``trial.episodes``, continues the best ``1/eta`` of them from their
checkpoints to ``eta`` times the episodes, and so on for ``rungs`` rounds.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import random
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentjet_client.errors import StudyError
from agentjet_client.research.tuning import AdjustRule, PbtSection

# `up` options the runner sets for each trial itself
RUNNER_SERVER_OPTIONS = ("host", "port", "state_dir", "resume", "fresh", "config")
CLIENT_SPACE_KEYS = ("code_dir", "concurrency", "group_size", "seed", "timeout")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StudySection(_Section):
    name: str = "study"
    search: Literal["grid", "random", "halving"] = "grid"
    metric: Literal["eval_reward", "train_reward"] = "eval_reward"
    trials: int | None = Field(default=None, ge=1, description="random draws (random search; halving may use it)")
    seed: int = 0
    parallel: int | Literal["auto"] = "auto"
    cores_per_trial: int = Field(default=2, ge=1)
    memory_per_trial_gb: float = Field(default=3.0, gt=0)
    devices: list[str] = Field(default_factory=list, description="one trial per device: its server gets --device")
    max_resumes: int = Field(default=2, ge=0)
    total_minutes: float | None = Field(default=None, gt=0)
    eta: int = Field(default=2, ge=2, description="halving: keep the best 1/eta at each rung")
    rungs: int = Field(default=2, ge=1, description="halving: rounds, each eta times the episodes of the last")
    server_command: list[str] = Field(default_factory=lambda: ["agentjet-server"])
    poll_seconds: float = Field(default=2.0, gt=0)

    @field_validator("parallel")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError('parallel is a number of trials at once (1 or more), or "auto"')
        return value

    @field_validator("server_command", mode="before")
    @classmethod
    def _command(cls, value: object) -> object:
        return value.split() if isinstance(value, str) else value


class TrialSection(_Section):
    episodes: int = Field(ge=1, description="training episodes per trial (halving: at the first rung)")
    minutes: float | None = Field(default=None, gt=0, description="a trial running longer is stopped")
    eval_episodes: int = Field(default=0, ge=0, description="final evaluation round (0 = one per eval task)")
    start_timeout_s: float = Field(default=300.0, gt=0, description="a server must answer within this")


class ClientSection(_Section):
    code_dir: Path
    concurrency: int = Field(default=32, ge=1)
    group_size: int | None = Field(default=None, ge=1, description="None: the trial server's group_size")
    seed: int | None = 0
    timeout: float = Field(default=300.0, gt=0)
    eval_every: int = Field(default=0, ge=0)
    eval_episodes: int = Field(default=0, ge=0)
    env: dict[str, str] = Field(default_factory=dict)
    args: list[str] = Field(default_factory=list, description="more `agentjet-client run` arguments")


class StopSection(_Section):
    """Early stopping; see ``stopping.py`` for what each rule reads."""

    window: int = Field(default=400, ge=1, description="training episodes per reward point")
    min_episodes: int = Field(default=0, ge=0, description="no plateau before this many episodes")
    reward_floor: float = Field(default=0.0, description="the lowest reward an episode can get")
    reward_ceiling: float = Field(default=1.0, description="the highest reward an episode can get")
    max_drop: float | None = Field(default=0.5, gt=0, le=1, description="collapse: share of (best - floor) lost")
    drop_points: int = Field(default=3, ge=1, description="consecutive points below the line before a collapse")
    min_z: float = Field(default=4.0, ge=0, description="collapse: standard errors between best and the last points")
    plateau_points: int = Field(default=0, ge=0, description="points without a new best (0: no plateau rule)")
    plateau_delta: float = Field(default=0.01, ge=0, description="what counts as a new best")
    min_entropy: float | None = Field(default=None, ge=0)
    max_entropy: float | None = Field(default=None, gt=0)
    max_kl: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _range(self) -> StopSection:
        if self.reward_ceiling <= self.reward_floor:
            raise ValueError("reward_ceiling must be above reward_floor (the range of an episode's reward)")
        return self


class Study(_Section):
    study: StudySection = Field(default_factory=StudySection)
    trial: TrialSection
    server: dict[str, Any] = Field(default_factory=dict)
    client: ClientSection
    space: dict[str, Any] = Field(default_factory=dict)
    stop: StopSection = Field(default_factory=StopSection)
    pbt: PbtSection | None = None
    adjust: list[AdjustRule] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> Study:
        problems = self._tuning_problems()  # every one at once: a study file is fixed in one go, not one error a run
        taken = [k for k in self.server if k.replace("-", "_") in RUNNER_SERVER_OPTIONS]
        if taken:
            problems.append(
                f"[server] sets {', '.join(taken)}; the runner gives every trial its own port and state dir: "
                "leave them out"
            )
        for key, values in self.space.items():
            section, _, name = key.partition(".")
            if section not in ("server", "client") or not name:
                problems.append(f"[space] key '{key}': write server.NAME (an `up` option) or client.NAME")
            elif section == "server" and name.replace("-", "_") in RUNNER_SERVER_OPTIONS:
                problems.append(f"[space] key '{key}': the runner sets {name} for each trial")
            elif section == "client" and name not in CLIENT_SPACE_KEYS and not name.startswith("env."):
                problems.append(
                    f"[space] key '{key}': the client settings a study can search are "
                    f"{', '.join(CLIENT_SPACE_KEYS)} and env.NAME"
                )
            else:
                try:
                    _check_domain(key, values, ranges=self.study.search == "random" or bool(self.study.trials))
                except ValueError as exc:
                    problems.append(str(exc))
        if self.study.search == "random" and self.study.trials is None:
            problems.append('search = "random" draws [study] trials configurations: set trials (e.g. 8)')
        if not self.space:
            problems.append('[space] is empty: name at least one setting to search, e.g. "server.lr" = [1e-3, 3e-3]')
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _tuning_problems(self) -> list[str]:
        problems = []
        if self.pbt is not None:
            if self.study.search == "halving":
                problems.append(
                    "[pbt] and halving both decide which trials go on: choose one (grid or random with pbt)"
                )
            keys = self.pbt_keys()
            outside = [k for k in keys if not k.startswith("server.") or k not in self.space]
            if outside:
                problems.append(
                    f"[pbt] keys {', '.join(outside)}: explore changes searched server settings (server.NAME keys "
                    "of [space]) on a running server"
                )
            elif not keys:
                problems.append('[pbt] explores searched server settings, and [space] has none: add e.g. "server.lr"')
        for rule in self.adjust:
            taken = [name for name in rule.set if name.replace("-", "_") in RUNNER_SERVER_OPTIONS]
            if taken:
                problems.append(f"[[adjust]] sets {', '.join(taken)}: the runner owns those")
        return problems

    def pbt_keys(self) -> list[str]:
        """The settings population-based training explores (``server.NAME``)."""
        if self.pbt is None:
            return []
        return (
            list(self.pbt.keys)
            if self.pbt.keys is not None
            else sorted(k for k in self.space if k.startswith("server."))
        )

    def draw(self, key: str, rng: random.Random) -> Any:
        """A fresh value of ``key`` from its [space] domain."""
        return _draw(self.space[key], rng)

    # -- planning ---------------------------------------------------------------------------------
    def configurations(self) -> list[dict[str, Any]]:
        """Each trial's searched settings (``{"server.lr": 0.001, ...}``), in trial order."""
        keys = sorted(self.space)
        if self.study.search == "random" or (self.study.search == "halving" and self.study.trials):
            rng = random.Random(self.study.seed)
            return [{k: _draw(self.space[k], rng) for k in keys} for _ in range(self.study.trials or 1)]
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(self.space[k] for k in keys))]

    def server_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The trial's `up` job file: the base [server] with the trial's server.* values."""
        out = {k.replace("-", "_"): v for k, v in self.server.items()}
        out.update(
            {k.removeprefix("server.").replace("-", "_"): v for k, v in settings.items() if k.startswith("server.")}
        )
        return out

    def client_settings(self, settings: dict[str, Any], base_dir: Path) -> ClientSection:
        """The trial's client run: the base [client] with the trial's client.* values, code dirs
        made absolute (relative ones are relative to the study file)."""
        data = self.client.model_dump()
        env = dict(data["env"])
        for key, value in settings.items():
            if key.startswith("client.env."):
                env[key.removeprefix("client.env.")] = str(value)
            elif key.startswith("client."):
                data[key.removeprefix("client.")] = value
        data["env"] = env
        code_dir = Path(data["code_dir"]).expanduser()
        data["code_dir"] = code_dir if code_dir.is_absolute() else (base_dir / code_dir).resolve()
        return ClientSection.model_validate(data)


def _check_domain(key: str, values: Any, ranges: bool) -> None:
    if isinstance(values, list):
        if not values:
            raise ValueError(f"[space] {key} is an empty list; give it at least one value")
        return
    if isinstance(values, dict) and len(values) == 1:
        ((kind, bounds),) = values.items()
        if kind in ("uniform", "log_uniform", "int_uniform"):
            if not (isinstance(bounds, list) and len(bounds) == 2 and all(isinstance(b, int | float) for b in bounds)):
                raise ValueError(f"[space] {key}: {kind} takes [low, high], two numbers")
            low, high = bounds
            if not low <= high or (kind == "log_uniform" and low <= 0):
                raise ValueError(
                    f"[space] {key}: {kind} needs low <= high{' and low > 0' if kind == 'log_uniform' else ''}"
                )
            if not ranges:
                raise ValueError(
                    f"[space] {key} is a range ({kind}); a grid needs lists of values. Give a list, "
                    'or use search = "random" (or halving with [study] trials)'
                )
            return
    raise ValueError(
        f"[space] {key} = {values!r}: give a list of values, or {{ uniform = [a, b] }}, "
        "{ log_uniform = [a, b] } or { int_uniform = [a, b] } for random search"
    )


def _draw(values: Any, rng: random.Random) -> Any:
    if isinstance(values, list):
        return rng.choice(values)
    ((kind, (low, high)),) = values.items()
    if kind == "uniform":
        return round(rng.uniform(low, high), 6)
    if kind == "int_uniform":
        return rng.randint(int(low), int(high))
    return float(f"{math.exp(rng.uniform(math.log(low), math.log(high))):.3g}")


def load_study(path: Path, check_code: bool = True) -> tuple[Study, str]:
    """The study in ``path`` and the hash of its text (a restarted runner checks it is the same)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise StudyError(f"cannot read the study file {path}: {exc.strerror}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise StudyError(f"the study file {path} is not valid TOML: {exc}") from exc
    if "space" in data:  # dotted keys written bare (server.lr = [...]) arrive as nested tables
        data["space"] = _flatten(data["space"])
    try:
        study = Study.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"[{'.'.join(str(x) for x in e['loc'])}] {str(e['msg']).removeprefix('Value error, ')}"
            if e["loc"]
            else str(e["msg"]).removeprefix("Value error, ")
            for e in exc.errors()
        )
        raise StudyError(f"the study file {path} is not a valid study: {problems} (see docs/research.md)") from exc
    code_problems: list[str] = []
    code_dirs = {study.client_settings(s, path.parent).code_dir for s in [{}, *study.configurations()[:64]]}
    for code_dir in sorted(code_dirs) if check_code else []:
        if not (code_dir / "agent.py").exists():
            code_problems.append(f"client code_dir {code_dir} has no agent.py (paths are relative to the study file)")
        elif study.study.metric == "eval_reward" and not (code_dir / "agentjet.toml").exists():
            code_problems += _eval_tasks_problem(code_dir)
    if code_problems:
        raise StudyError(f"{path}: " + "; ".join(code_problems))
    return study, hashlib.sha256(text.encode()).hexdigest()[:16]


_EVAL_TASKS = """
import json, sys
from pathlib import Path
from agentjet_client.errors import AgentJetError
from agentjet_client.run.loader import load_agent
try:
    agent, _ = load_agent(Path(sys.argv[1]))
except AgentJetError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    print(json.dumps({"eval_tasks": agent.eval_tasks is not None}))
"""


_EVAL_TASKS_SEEN: dict[tuple[Path, str], list[str]] = {}  # (code dir, code version) -> its problems


def _eval_tasks_problem(code_dir: Path) -> list[str]:
    from agentjet_client.run.loader import code_version

    key = (code_dir, code_version(code_dir))
    if key not in _EVAL_TASKS_SEEN:
        _EVAL_TASKS_SEEN[key] = _load_eval_tasks(code_dir)
    return _EVAL_TASKS_SEEN[key]


def _load_eval_tasks(code_dir: Path) -> list[str]:
    """Why the agent in ``code_dir`` cannot give ``metric = "eval_reward"``, if it cannot (an agent in its
    own interpreter, ``agentjet.toml``, is checked by its first trial instead). The agent is loaded in an
    interpreter of its own, in its code dir: loading runs its code, and that never happens in the
    runner's process."""
    import subprocess
    import sys

    try:
        done = subprocess.run(
            [sys.executable, "-c", _EVAL_TASKS, str(code_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=str(code_dir),
        )
    except subprocess.TimeoutExpired:
        return [f"loading the agent in {code_dir} took over 120s"]
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        lines = [x for x in done.stderr.splitlines() if x.strip()]
        return [f"loading the agent in {code_dir} failed: {' | '.join(lines[-3:])}"]
    if "error" in answer:
        return [str(answer["error"])]
    if not answer["eval_tasks"]:
        return [
            f'metric = "eval_reward" needs held-out tasks, and the agent in {code_dir} has none: give it '
            '@swarm_agent(eval_tasks=...), or set [study] metric = "train_reward"'
        ]
    return []


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        is_domain = (
            isinstance(value, dict)
            and len(value) == 1
            and next(iter(value))
            in (
                "uniform",
                "log_uniform",
                "int_uniform",
            )
        )
        if isinstance(value, dict) and not is_domain:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def machine_parallel(section: StudySection, population: int | None = None) -> tuple[int, str]:
    """How many trials run at once, and why. Each trial is a server (the model, its learner and
    engine) plus a client: on CPU it wants ``cores_per_trial`` cores (its torch threads are set to
    that) and ``memory_per_trial_gb`` of memory; with ``devices`` listed, one trial per device.
    Population-based training (``population`` trials) runs them all at once."""
    if section.devices:
        n = len(section.devices)
        reason = f"one trial per listed device ({n})"
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        free_gb = _available_memory_gb()
        by_cores = max(1, cores // section.cores_per_trial)
        by_memory = max(1, int(free_gb // section.memory_per_trial_gb)) if free_gb is not None else by_cores
        n = min(by_cores, by_memory)
        memory = f", {free_gb:.1f} GiB free / {section.memory_per_trial_gb:g} GiB per trial" if free_gb else ""
        reason = f"{cores} cores / {section.cores_per_trial} per trial{memory}"
    if population is not None:
        return (
            population,
            f"population-based training runs all {population} trials at once (the machine: {n}; {reason})",
        )
    if section.parallel != "auto":
        if section.parallel > n:
            return section.parallel, f"as set in the study (the machine suggests {n}: {reason})"
        return section.parallel, "as set in the study"
    return n, reason


def _available_memory_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        return None
    return None


def toml_text(settings: dict[str, Any]) -> str:
    """Flat ``key = value`` lines (an `up` job file)."""
    return "".join(f"{key} = {_toml(value)}\n" for key, value in settings.items() if value is not None)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))


def study_of(out: Path) -> Study:
    """The study a --out dir was made from (its copy of the file)."""
    study, _ = load_study(out / "study.toml", check_code=False)
    return study
