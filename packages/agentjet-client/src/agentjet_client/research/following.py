"""A round's study under ``research auto``: started (or continued, after a kill) through the tools a
coding agent uses, followed until its runner finishes, stopped with checkpoints when a budget runs out."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agentjet_client.research.autostate import Ledger, Round
from agentjet_client.research.tools import ToolError, Workspace


class StudyFollower:
    def __init__(
        self,
        workspace: Workspace,
        ledger: Ledger,
        say: Callable[[str], None],
        log: Callable[..., None],
        save: Callable[[], None],
        poll_s: float,
    ) -> None:
        self.workspace, self.ledger, self.say, self.log, self.save, self.poll_s = (
            workspace,
            ledger,
            say,
            log,
            save,
            poll_s,
        )

    # -- the study --------------------------------------------------------------------------------
    def follow(self, round_: Round) -> None:
        assert round_.study is not None
        study_file = f"{round_.folder}/study.toml"
        status = self._status(round_)
        if status is None or status["runner"] == "not running":
            spent = self.ledger.spent()
            if spent and status is not None:  # stopped for the budget: judged as it stands
                round_.budget_stop = spent
                round_.phase = "judging"
                return
            self.say(f"round {round_.number}: {'starting' if status is None else 'continuing'} its study")
            try:
                self.workspace.start_study(study_file, round_.study)
            except ToolError as exc:
                now = self._status(round_)
                if now is not None and now["runner"] != "not running":
                    return  # a runner of its own took it meanwhile: followed from the next step
                round_.phase = "abandoned"
                round_.reason = f"its study would not start: {exc}"
                self.log("decision", round_, decision="abandoned", problems=[str(exc)])
                return
            self.log("study", round_, message="started")
        last = ""
        while True:
            status = self._status(round_)
            if status is None:
                time.sleep(self.poll_s)
                continue
            done = sum(t["phase"] == "done" for t in status["trials"])
            line = f"round {round_.number}: study {done}/{len(status['trials'])} trials done"
            if line != last:
                self.say(line)
                last = line
            if status["runner"] == "finished":
                round_.phase = "judging"
                return
            if status["runner"] == "not running":
                return  # the runner died: the next step continues it
            spent = self.ledger.spent()
            if spent and round_.budget_stop is None:
                round_.budget_stop = spent
                self.say(f"round {round_.number}: {spent}: stopping its study (its trials checkpoint)")
                try:
                    self.workspace.stop_study(round_.study)
                except ToolError:
                    pass
                self.save()
            time.sleep(self.poll_s)

    def _status(self, round_: Round) -> dict[str, Any] | None:
        assert round_.study is not None
        try:
            return self.workspace.study_status(round_.study)
        except ToolError:
            return None
