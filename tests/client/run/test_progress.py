"""The live line of ``agentjet-client run`` in a pipe: a line per interval, only when something changed."""

from __future__ import annotations

import io

from rich.console import Console

from agentjet_client.run.progress import RunProgress


def test_in_a_pipe_a_line_is_printed_per_interval_and_never_the_same_twice():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    now = [0.0]
    figures = ["reward(64) 0.100  spool 3"]
    with RunProgress(console, 100, lambda: figures[0], interval=10.0, clock=lambda: now[0]) as progress:
        for second in range(1, 61):
            now[0] = float(second)
            finished = min(second * 2, 100)
            progress.update(finished)
        # done at second 50; then the run waits for the learner: nothing changes, nothing is printed
        figures[0] = "reward(64) 0.500  spool 0"
        now[0] = 61.0
        progress.update(100, force=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == len(set(lines)) == 7, lines  # seconds 1, 11, 21, 31, 41, 51 and the final one
    assert lines[0].startswith("episodes 2/100  2.00 eps/s  ETA 0:00:49")
    assert lines[-1] == "episodes 100/100  1.64 eps/s  reward(64) 0.500  spool 0"


def test_in_a_terminal_it_is_one_rewritten_line():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    with RunProgress(console, 10, lambda: "policy v3") as progress:
        for k in range(11):
            progress.update(k)
    text = out.getvalue()
    assert "10/10" in text and "policy v3" in text
    assert "\x1b[" in text  # drawn with terminal control sequences, not printed line by line
