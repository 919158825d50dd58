"""Live retuning: ``LiveTuner`` carries out a study's ``[pbt]`` and ``[[adjust]]`` (``tuning.py``) on
the trials that train now, through each trial server's admin API, once per poll of the runner.

Every change is written three times: in the trial's events (``trial.json``), as a line of
``OUT/changes.jsonl`` (the report's "Live changes" table reads it), and by the server itself in its
``metrics.jsonl`` (``adopt`` and ``config`` lines). A trial's ``changed`` holds its settings as they
are now: the report's best configuration uses them.

An exploit copies the better trial's newest checkpoint into the worse trial's directory
(``adopted/``, hard links where the file system allows) before the worse trial's server reads it:
the better trial's server may prune that checkpoint at any time. The worse trial's server
checkpoints at once after adopting it, and the copy is removed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2

from agentjet_client.research.driver import Live
from agentjet_client.research.study import Study
from agentjet_client.research.trial import TrialRecord
from agentjet_client.research.tuning import Candidate, exploit_choice, explore

CHANGES_FILE = "changes.jsonl"


class LiveTuner:
    def __init__(self, study: Study, out: Path, say: Callable[[str], None]) -> None:
        self.study, self.out, self.say = study, out, say
        self.rng = random.Random(study.study.seed)

    def tick(self, records: dict[str, TrialRecord], live: dict[str, Live]) -> None:
        training = [r for r in records.values() if r.phase == "training" and r.id in live]
        for record in training:
            for index in range(len(self.study.adjust)):
                self._rule(record, live[record.id], index)
        if self.study.pbt is not None:
            self._pbt(training, records, live)

    # -- rules ------------------------------------------------------------------------------------
    def _rule(self, record: TrialRecord, live: Live, index: int) -> None:
        rule = self.study.adjust[index]
        state = record.rules.setdefault(str(index), {"times": 0, "after": 0})
        if state["times"] >= rule.max_times:
            return
        fired = rule.fires([s for s in live.series.steps if int(s.get("step", 0)) > state["after"]])
        if fired is None:
            return
        mean, step = fired
        state["after"] = step + rule.cooldown_steps
        try:
            before = live.probe.config()
            after = rule.new_values(before)
            live.probe.change(after)
        except (httpx2.HTTPError, ValueError, KeyError) as exc:
            record.note(f"adjust ({rule.when}) could not change {', '.join(rule.set)}: {exc}")
            return
        state["times"] += 1
        record.changed.update({f"server.{k}": v for k, v in after.items()})
        figure = rule.condition()[0]
        what = ", ".join(f"{k} {before.get(k)} -> {v}" for k, v in after.items())
        why = f"{figure} {mean:.4g} over {rule.over} steps (step {step}): {rule.when}"
        record.note(f"adjust: {why}; {what} ({state['times']}/{rule.max_times})")
        self.say(f"{record.id} adjust: {what} ({why})")
        self._log(
            "adjust",
            record,
            rule=rule.when,
            figure=figure,
            value=mean,
            step=step,
            before={k: before.get(k) for k in after},
            after=after,
        )

    # -- population-based training ----------------------------------------------------------------
    def _score(self, record: TrialRecord, live: Live) -> Candidate | None:
        """The mean of the trial's last ``points`` training reward windows since its last exploit,
        with the episodes it averages and the largest variance rewards in [reward_floor,
        reward_ceiling] can have at that mean (as the collapse rule bounds it)."""
        assert self.study.pbt is not None
        points = live.series.train[record.scored_from :][-self.study.pbt.points :]
        if len(points) < self.study.pbt.points:
            return None
        n = sum(p.n for p in points)
        mean = sum(p.reward * p.n for p in points) / n
        low, high = min(self.study.stop.reward_floor, mean), max(self.study.stop.reward_ceiling, mean)
        return Candidate(record.id, mean, n, (mean - low) * (high - mean))

    def _pbt(self, training: list[TrialRecord], records: dict[str, TrialRecord], live: dict[str, Live]) -> None:
        pbt = self.study.pbt
        assert pbt is not None
        scores = {r.id: c for r in training if (c := self._score(r, live[r.id])) is not None}
        for record in training:
            if record.episodes < pbt.burn_in_episodes or record.episodes - record.pbt_ready_at < pbt.every_episodes:
                continue
            record.pbt_ready_at = record.episodes
            if record.id not in scores:
                continue
            donor = exploit_choice(record.id, list(scores.values()), pbt.quantile, self.rng, pbt.min_z)
            if donor is None:
                continue
            if self._exploit(record, records[donor], live, scores):
                scores.pop(record.id)  # its score starts again from its next windows

    def _exploit(
        self, record: TrialRecord, donor: TrialRecord, live: dict[str, Live], scores: dict[str, Candidate]
    ) -> bool:
        assert self.study.pbt is not None
        own, other = live[record.id], live[donor.id]
        keys = self.study.pbt_keys()
        copy: Path | None = None
        try:
            source = Path(other.probe.checkpoint())
            copy = own.files.path / "adopted" / f"{donor.id}-{source.name}"
            _link_tree(source, copy)
            adopted = own.probe.adopt(str(copy))
            theirs, mine = other.probe.config(), own.probe.config()
            values = {k: theirs[k.removeprefix("server.")] for k in keys}
            new = explore(values, self.study.pbt.perturb, self.study.pbt.resample, self._draw, self.rng)
            own.probe.change({k.removeprefix("server."): v for k, v in new.items()})
        except (httpx2.HTTPError, ValueError, KeyError, OSError) as exc:
            record.note(f"pbt: taking {donor.id}'s checkpoint failed: {exc}")
            self.say(f"{record.id} pbt: taking {donor.id}'s checkpoint failed: {exc}")
            return False
        finally:
            if copy is not None:
                shutil.rmtree(copy, ignore_errors=True)
        record.exploits += 1
        record.scored_from = len(own.series.train) + 1  # the next window mixes episodes of both policies
        record.changed.update(new)
        what = ", ".join(
            f"{k.removeprefix('server.')} {mine.get(k.removeprefix('server.'))} -> {v}" for k, v in new.items()
        )
        step = adopted.get("source_step")
        own_score, their_score = scores[record.id].score, scores[donor.id].score
        record.note(
            f"pbt: took {donor.id}'s checkpoint (its step {step}; score {their_score:.3f} against {own_score:.3f} "
            f"at {record.episodes} episodes); explore: {what}"
        )
        donor.note(f"pbt: {record.id} took its checkpoint (step {step})")
        self.say(f"{record.id} pbt: exploits {donor.id} ({their_score:.3f} > {own_score:.3f}); explores {what}")
        self._log(
            "exploit",
            record,
            donor=donor.id,
            donor_step=step,
            score=own_score,
            donor_score=their_score,
            before={k: mine.get(k.removeprefix("server.")) for k in new},
            after=new,
            policy_version=adopted.get("policy_version"),
        )
        return True

    def _draw(self, key: str) -> Any:
        return self.study.draw(key, self.rng)

    def _log(self, kind: str, record: TrialRecord, **values: Any) -> None:
        line = {"time": round(time.time(), 3), "kind": kind, "trial": record.id, "episodes": record.episodes, **values}
        with (self.out / CHANGES_FILE).open("a") as f:
            f.write(json.dumps(line) + "\n")


def read_changes(out: Path) -> list[dict[str, Any]]:
    """The study's live changes, oldest first (``OUT/changes.jsonl``)."""
    path = out / CHANGES_FILE
    if not path.exists():
        return []
    lines = []
    for text in path.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:  # a line cut by a crash
            continue
    return lines


def _link_tree(source: Path, target: Path) -> None:
    """``source`` copied to ``target``, files hard-linked where the file system allows."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, target, copy_function=link)
