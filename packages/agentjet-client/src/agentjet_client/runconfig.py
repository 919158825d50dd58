"""How a run goes: one frozen set of settings that the runner and its parts (rollouts, group starts,
admission, delivery) read, filled from ``agentjet-client run``'s flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunConfig:
    episodes: int = 0  # 0 = run until stopped
    group_size: int = 8
    concurrency: int = 16
    timeout: float = 300.0
    admission: bool = True
    poll_interval: float = 0.2
    seed: int | None = None
    send_batch: int = 256
    backoff_max: float = 30.0  # seconds between resends while the server does not answer
    watch_interval: float = 1.0  # seconds between looks at the code dir (with a watcher)
    eval_every: int = 0  # policy versions between evaluation rounds (0 = none; also one at the start)
    eval_episodes: int = 0  # episodes per evaluation round, over the agent's eval_tasks in order
    eval_only: bool = False  # one evaluation round, no training episodes (``agentjet-client eval``)
    sync: bool = False  # one batch at a time: roll out, wait for the step, repeat (see the module docstring)
    # stop above this share of failed episodes (None: ``StopRule``'s default; 1.0, for library use: never)
    max_failure_rate: float | None = 1.0
    follow_group_size: bool = False  # new groups take the server's group size when an admin changes it
    epochs: int = 0  # passes over the tasks before the run ends (0 = no end but ``episodes``)
    repeats: int = 1  # groups of each task per epoch
    shuffle: bool = True  # each epoch in a seeded random order (else the source's order)
    dynamic_sampling: bool = False  # pass over tasks whose recent groups were all tied (``sampling``)
