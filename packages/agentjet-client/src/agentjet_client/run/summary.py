"""What a run tells its user: the figures on its progress line while it goes, the summary at its end, and
the verdict (why it failed, if it did). Plain text; the command line prints it."""

from __future__ import annotations

import math

from agentjet_client.run.config import RunConfig
from agentjet_client.run.report import RunReport


def figures(report: RunReport, unanswered: int) -> str:
    """The progress line's figures: recent reward, the newest evaluation, version, answers, spool."""
    parts = []
    if report.rewards:
        parts.append(f"reward(64) {report.recent_mean(64):.3f}")
    if report.eval_rewards:
        at = max(report.eval_rewards)
        rewards = report.eval_rewards[at]
        parts.append(f"eval {sum(rewards) / len(rewards):.3f}@v{at}")
    parts.append(f"policy v{_version(report.last_version)}")
    parts.append(f"accepted {report.accepted}  rejected {report.rejected}  failed {report.failed}")
    parts.append(f"spool {unanswered}")
    return "  ".join(parts)


def verdict(report: RunReport, config: RunConfig) -> str | None:
    """Why the run failed (its exit code is then 3): it stopped because its episodes kept failing, or it
    delivered nothing at all. None: it did not."""
    top = report.failure_reasons.most_common(1)
    cause = f"; most often: {top[0][1]} x {top[0][0]} (its traceback is above)" if top else ""
    if report.stopped is not None:
        return f"the run stopped: {report.stopped}{cause}"
    if not config.eval_only and report.finished and not report.accepted:
        return f"no episode of this run was accepted by the server{cause}"
    return None


def _version(version: int | None) -> str:
    return "-" if version is None else str(version)


def _mean(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def summary(report: RunReport, config: RunConfig) -> list[str]:
    """The lines that end a run: episodes, rewards and versions, then whatever else the run has to say."""
    lines = []
    if not config.eval_only:
        means = (
            f"mean reward first 10% {_mean(report.mean(0.0, 0.1))}  last 20% {_mean(report.mean(0.8, 1.0))}"
            if report.rewards
            else "no episode completed (mean reward -)"
        )
        last = report.last_version if report.last_version is not None else report.first_version
        lines.append(
            f"done: {report.finished} episodes in {report.elapsed_s:.0f}s  {means}  "
            f"policy v{_version(report.first_version)} -> v{_version(last)}  "
            f"accepted {report.accepted}  duplicate {report.duplicate}  rejected {report.rejected}  "
            f"failed {report.failed}"
        )
    lines += report.notes
    rates = report.tasks
    if rates.tasks and not config.eval_only:
        skipped = sum(rates.skipped.values())
        lines.append(
            f"tasks: {len(rates.tasks)} played, {rates.tied_share:.0%} of their finished groups had equal rewards"
            + (f", {skipped} groups of tasks always or never solved passed over" if skipped else "")
        )
    judged = report.judging
    if judged:
        lines.append(
            f"judge: {judged['calls']} calls answered ({judged['unparsed']} without usable scores), "
            f"{judged['errors']} unanswered, {judged['prompt_tokens']} prompt + {judged['completion_tokens']} "
            "completion tokens, "
            f"{judged['milliseconds'] / 1000:.1f}s; besides them, {judged['cached']} groups judged from the "
            "answers kept in the spool (no call)"
        )
    lines += [f"failed: {count} x {line}" for line, count in report.failure_reasons.most_common(3)]
    if report.eval_rewards:
        rounds = "  ".join(f"v{v}: {sum(r) / len(r):.3f} ({len(r)})" for v, r in sorted(report.eval_rewards.items()))
        lines.append(f"evaluation mean reward by policy version: {rounds}")
    elif config.eval_only:
        lines.append(f"evaluation: no episode completed ({report.failed} failed)")
    if report.reloads or report.reload_errors:
        lines.append(f"episodes per code version: {dict(report.code_versions)}")
    if report.resent_leftovers:
        lines.append(f"delivered {report.resent_leftovers} trajectories an earlier run had left in the spool")
    if len(report.episodes_by_tag) > 1:
        for tag, started in sorted(report.episodes_by_tag.items()):
            rewards = report.tag_rewards.get(tag, [])
            mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
            lines.append(f"tag {tag or '(none)'}: {started} episodes started, mean reward {mean}")
    if len(report.agent_rewards) > 1 or len(report.by_server) > 1:
        lines += [
            f"agent {name}: {report.turns_by_agent[name]} turns, mean reward first 10% "
            f"{_mean(report.mean(0.0, 0.1, name))}  last 20% {_mean(report.mean(0.8, 1.0, name))}"
            for name in sorted(report.agent_rewards)
        ]
    if len(report.by_server) > 1:
        for url, counts in report.by_server.items():
            lines.append(f"{url}: " + "  ".join(f"{k} {n}" for k, n in sorted(counts.items())))
    if report.reject_reasons:
        lines.append(f"rejections: {dict(report.reject_reasons)}")
    return lines
