"""``agentjet-client try``: one episode of an agent, shown as a transcript, pushed nowhere unless asked.

The quickest check of an agent before a run: its first task (or ``--task ID``) is played once against
the server, and every captured call is printed (what the agent sent that was new, what the model
answered, its tool calls), then the reward, or the failure with the agent's own traceback. With
``--push`` the episode is pushed as an evaluation episode (recorded by policy version, never trained:
one episode is no GRPO group).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from agentjet_client.client import SwarmClient
from agentjet_client.failures import Failure, describe
from agentjet_client.protocol import Trajectory, TrajectoryStatus
from agentjet_client.run.isolation import AgentFailed
from agentjet_client.run.report import coerce_reward
from agentjet_client.run.tracks import Track
from agentjet_client.tasks.judges import JudgeError
from agentjet_client.tasks.rewards import Scored


@dataclass
class Tried:
    """What one tried episode did: its trajectory, each call's answer, and its reward or failure."""

    trajectory: Trajectory
    answers: list[Any]
    reward: float | None
    failure: Failure | None
    pushed: str | None = None  # the server's answer, with --push
    components: dict[str, float] | None = None  # a reward stage's (a Rubric's) scores, or the judge's
    judged: str | None = None  # what the judge said, for an agent rewarded by one


async def try_episode(client: SwarmClient, track: Track, task_id: str | None, timeout: float, push: bool) -> Tried:
    """Play one episode of ``track``'s agent on ``task_id`` (default: its first task)."""
    tasks = track.load_tasks()
    chosen = [t for t in tasks if task_id is None or t[0] == task_id]
    if not chosen:
        raise ValueError(
            f"no task with id {task_id!r}; the agent's first task ids: {', '.join(t[0] for t in tasks[:8])}"
        )
    tid, task = chosen[0]
    episode = client.episode(f"try:{tid}", task_tag=track.tag, purpose="eval")
    reward, failure, components, judged = None, None, None, None
    with ThreadPoolExecutor(max_workers=1) as executor:
        try:
            value, _ = await track.play(track.agent, task, episode, timeout, executor)
            judge = track.judge
            if judge is not None:  # judged alone, as an evaluation episode of a run is
                try:
                    verdict = await judge.judge(task, [value])
                finally:
                    await judge.aclose()
                reward, components, judged = verdict.scores[0], {"judge": verdict.scores[0]}, verdict.explanation
            elif isinstance(value, Scored):
                reward, components = value.reward, value.components
            else:
                reward, _ = coerce_reward(value)
        except JudgeError as exc:
            failure = Failure(f"{exc} (the agent ran: its calls are above)", "")
        except TimeoutError:
            failure = Failure(f"episode timed out after {timeout:g}s (--timeout)", "")
        except AgentFailed as exc:
            failure = Failure(str(exc), exc.trace)
        except Exception as exc:  # the agent's bug: shown with its own frames
            failure = describe(exc)
        finally:
            await episode.aclose()
    status: TrajectoryStatus = "complete" if failure is None else "failed"
    metadata: dict[str, Any] = {"task": tid}
    if components:
        metadata["reward_components"] = components
    trajectory = episode.to_trajectory(
        reward or 0.0, status=status, error=failure.line if failure else None, metadata=metadata
    )
    tried = Tried(trajectory, episode.recorder.answers(), reward, failure, components=components, judged=judged)
    if push:
        result = client.submit([trajectory]).results[0]
        tried.pushed = result.status + (f" ({result.reason})" if result.reason else "")
    return tried


def transcript(tried: Tried) -> Iterator[str]:
    """The episode for people: each call's new messages, its answer and tool calls; then the outcome."""
    seen: dict[str, int] = {}  # agent -> messages shown of its conversation
    for index, (turn, answer) in enumerate(zip(tried.trajectory.turns, tried.answers, strict=True)):
        yield (
            f"── call {index}  agent {turn.agent}  policy v{turn.policy_version}  "
            f"{len(turn.prompt_token_ids)} prompt + {len(turn.completion_token_ids)} sampled tokens  "
            f"finish {turn.finish_reason}"
        )
        messages = turn.request_messages
        start = seen.get(turn.agent, 0)
        new = messages[start + 1 :] if 0 < start < len(messages) else messages[start:]  # not its own answer again
        for message in new:
            yield f"   {message.get('role', '?')}: {_content(message)}"
        seen[turn.agent] = len(messages)
        text, calls = answer if answer is not None else ("", ())
        yield f"   -> answer: {text!r}"
        for name, arguments in calls:
            yield f"   -> tool call {name}({arguments})"
    if tried.failure is not None:
        yield f"failed: {tried.failure.line}"
        if tried.failure.trace and tried.failure.trace != tried.failure.line:
            yield tried.failure.trace
    else:
        parts = ", ".join(f"{name} {score:g}" for name, score in (tried.components or {}).items())
        yield f"reward {tried.reward:g}" + (f" ({parts})" if parts else "")
        if tried.judged:
            yield f"   the judge said: {tried.judged[:500]!r}"
    if tried.pushed is not None:
        yield f"pushed as an evaluation episode: {tried.pushed}"


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content blocks: their text
        content = " ".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
    calls = [c.get("function", {}) for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    shown = repr(content) if content else ""
    for call in calls:
        shown += f" [calls {call.get('name')}({call.get('arguments')})]"
    return shown.strip() or json.dumps(message)[:200]
