"""Failed episodes as a user can act on them.

``describe`` reduces an agent's exception to one line that names its own code (``KeyError: 'questoin'
(agent.py:23 in solve)``) and a traceback of the agent's frames only: frames of AgentJet, of the Python
installation and of installed packages are left out. ``FailureLog`` logs the first failure of each
kind with that traceback and counts the rest (a line at the 2nd, 4th, 8th... occurrence), so a typo
that fails every episode prints its location once, not once per episode. ``StopRule`` decides when a
run whose episodes keep failing should stop rather than run to its end: by default when every episode
of the first finished group failed, or every one of the first 5% of the run's episodes; with
``max_rate``, when more than that share of the finished training episodes failed.
"""

from __future__ import annotations

import logging
import math
import site
import sysconfig
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

_OURS = str(Path(__file__).resolve().parent)
_PATHS = sysconfig.get_paths()
_INSTALLED = tuple(
    {str(Path(p).resolve()) for p in (*site.getsitepackages(), _PATHS["stdlib"], _PATHS["purelib"], _PATHS["platlib"])}
)


def _agent_frame(frame: traceback.FrameSummary) -> bool:
    path = str(Path(frame.filename).resolve()) if not frame.filename.startswith("<") else frame.filename
    return not path.startswith(_OURS) and not path.startswith(_INSTALLED) and not frame.filename.startswith("<")


@dataclass(frozen=True)
class Failure:
    """An exception of an agent, reduced: ``line`` for logs and summaries, ``trace`` (the agent's own
    frames, then the exception) for the first of its kind."""

    line: str
    trace: str


def describe(exc: BaseException) -> Failure:
    """``exc`` as one line naming the innermost frame of the agent's own code, and its agent-only traceback."""
    what = "".join(traceback.format_exception_only(exc)).strip().splitlines()[-1]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _agent_frame(f)]
    if not frames:
        return Failure(what, what)
    last = frames[-1]
    line = f"{what} ({Path(last.filename).name}:{last.lineno} in {last.name})"
    trace = "Traceback (the agent's own frames):\n" + "".join(traceback.format_list(frames)) + what
    return Failure(line, trace)


@dataclass
class FailureLog:
    """Logs failed episodes: the first of each kind in full, the rest counted."""

    counts: Counter[str] = field(default_factory=Counter)

    def record(self, task: str, failure: Failure) -> None:
        self.counts[failure.line] += 1
        n = self.counts[failure.line]
        if n == 1:
            logger.warning("an episode of task %s failed: %s\n%s", task, failure.line, failure.trace)
        elif n & (n - 1) == 0:  # 2, 4, 8, ...: the count, not every episode
            logger.warning("%d episodes have failed so far with: %s", n, failure.line)
        else:
            logger.debug("an episode of task %s failed: %s", task, failure.line)


@dataclass
class StopRule:
    """When a run should stop because its training episodes keep failing (see the module docstring)."""

    group_size: int
    episodes: int = 0  # the run's training episodes (0: until stopped)
    max_rate: float | None = None
    finished: int = 0
    failed: int = 0
    _groups: dict[str, list[int]] = field(default_factory=dict)  # group -> [finished, failed]
    _first_group_done: bool = False

    def record(self, group: str, failed: bool) -> str | None:
        """Count a finished training episode of ``group``; the reason to stop, or None to go on."""
        self.finished += 1
        self.failed += failed
        counts = self._groups.setdefault(group, [0, 0])
        counts[0] += 1
        counts[1] += failed
        if self.max_rate is not None:
            if self.finished >= self.group_size and self.failed / self.finished > self.max_rate:
                return (
                    f"{self.failed} of {self.finished} episodes failed, more than --max-failure-rate {self.max_rate:g}"
                )
            return None
        if counts[0] == self.group_size and not self._first_group_done:
            self._first_group_done = True
            if counts[1] == self.group_size:
                return f"every episode of the first group ({self.group_size}) failed"
        first = math.ceil(0.05 * self.episodes) if self.episodes else 0
        if first and self.finished == first and self.failed == first:
            return f"every one of the first {first} episodes (5% of the run) failed"
        return None
