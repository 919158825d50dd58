"""The live line of ``agentjet-client run``: episodes, rate, ETA, running reward, spool depth.

In a terminal it is one line that rewrites itself (rich), with log lines printed above it; in a
pipe or a log file it is a plain line every ``interval`` seconds, printed only when something
changed (a run waiting for the learner prints nothing new, instead of the same line again).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn


class RunProgress:
    def __init__(
        self,
        console: Console,
        total: int,
        describe: Callable[[], str],
        *,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console
        self.total = total or None
        self.describe = describe  # the figures after the bar: reward, policy version, spool...
        self.interval = interval
        self._clock = clock
        self._started = clock()
        self._last_line: tuple[int, str] | None = None
        self._last_print = -math.inf
        self._progress: Progress | None = None
        self._task: Any = None
        if console.is_terminal:
            self._progress = Progress(
                TextColumn("episodes {task.completed:.0f}" + (f"/{total}" if total else "")),
                BarColumn(bar_width=24),
                TaskProgressColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[figures]}"),
                console=console,
                transient=False,
                refresh_per_second=4,
            )
            self._task = self._progress.add_task("episodes", total=self.total, rate="", figures="")

    def __enter__(self) -> RunProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def rate(self, finished: int) -> float:
        elapsed = self._clock() - self._started
        return finished / elapsed if elapsed > 0 else 0.0

    def update(self, finished: int, force: bool = False) -> None:
        figures = self.describe()
        rate = self.rate(finished)
        if self._progress is not None:
            self._progress.update(self._task, completed=finished, rate=f"{rate:.2f} eps/s", figures=figures)
            return
        now = self._clock()
        if not force and now - self._last_print < self.interval:
            return
        total = f"/{self.total}" if self.total else ""
        eta = ""
        if self.total and rate > 0 and finished < self.total:
            eta = f"  ETA {_duration((self.total - finished) / rate)}"
        if (finished, figures) == self._last_line:  # nothing new: say nothing
            return
        self.console.print(f"episodes {finished}{total}  {rate:.2f} eps/s{eta}  {figures}")
        self._last_line = (finished, figures)
        self._last_print = now


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
