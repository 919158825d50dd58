"""Timeline merging on hand-built episodes: which turns merge, and exactly which tokens are trained."""

from __future__ import annotations

from agentjet_client.protocol import Trajectory, Turn
from agentjet_server.batching.timeline import build_timelines, call_tokens
from agentjet_server.learner.batch import Sequence, build_batch
from agentjet_server.learner.packing import pack, unique_tokens

SYS, USER, TOOL, USER2 = [1, 2, 3], [10, 11, 12, 13], [20, 21, 22], [30, 31]


def turn(prompt: list[int], completion: list[int], agent: str = "default") -> Turn:
    logprobs = [-0.1 * (i + 1) for i in range(len(completion))]
    return Turn(
        agent=agent,
        policy_version=0,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=logprobs,
        finish_reason="stop",
    )


def trained_tokens(timeline) -> list[int]:  # type: ignore[no-untyped-def]
    return [timeline.tokens[p] for p in timeline.trained]


def test_multi_turn_tool_calls_merge_into_one_timeline_with_exact_masks():
    c1, c2, c3 = [100, 101, 199], [102, 103, 199], [104, 199]  # 199: the end-of-turn token the model sampled
    turns = [
        turn(SYS + USER, c1),
        turn(SYS + USER + c1 + TOOL, c2),  # the tool call's result comes back as untrained context
        turn(SYS + USER + c1 + TOOL + c2 + USER2, c3),
    ]
    [timeline] = build_timelines(turns)
    assert timeline.tokens == SYS + USER + c1 + TOOL + c2 + USER2 + c3
    assert trained_tokens(timeline) == c1 + c2 + c3
    start2 = len(SYS + USER + c1 + TOOL)
    end = len(timeline.tokens)
    assert timeline.trained == [7, 8, 9, start2, start2 + 1, start2 + 2, end - 2, end - 1]
    assert timeline.old_logprobs == [t for x in turns for t in x.completion_logprobs]
    assert timeline.turn_of == [0, 0, 0, 1, 1, 1, 2, 2] and timeline.turns == [0, 1, 2]
    assert len(timeline.tokens) < call_tokens(turns)


def test_agents_keep_separate_timelines():
    a1, b1, a2 = [100, 199], [150, 151, 199], [101, 199]
    turns = [
        turn(SYS + USER, a1, agent="planner"),
        turn([*SYS, 40, *a1], b1, agent="critic"),  # sees the planner's words, in its own conversation
        turn([*SYS, *USER, *a1, 41, *b1], a2, agent="planner"),
    ]
    planner, critic = build_timelines(turns)
    assert planner.agent == "planner" and planner.turns == [0, 2] and trained_tokens(planner) == a1 + a2
    assert critic.agent == "critic" and critic.turns == [1] and trained_tokens(critic) == b1
    # the critic's prompt holds a1 as context only: every sampled token is trained exactly once
    assert sorted(trained_tokens(planner) + trained_tokens(critic)) == sorted(a1 + b1 + a2)


def test_edited_history_and_drift_start_new_timelines():
    c1, c2, c3, c4 = [100, 199], [101, 199], [102, 199], [103, 199]
    summary = [60, 61]
    drifted = [100, 198]  # the same text re-tokenised differently from what was sampled
    turns = [
        turn(SYS + USER, c1),
        turn(SYS + USER + c1 + TOOL, c2),
        turn(SYS + summary, c3),  # memory compaction: the history was rewritten
        turn(SYS + summary + c3 + USER2, c4),  # continues the compacted conversation
        turn(SYS + USER + drifted + TOOL, c2),  # re-rendered history that no longer matches
    ]
    first, compacted, redrift = build_timelines(turns)
    assert first.turns == [0, 1] and trained_tokens(first) == c1 + c2
    assert compacted.turns == [2, 3] and compacted.tokens == SYS + summary + c3 + USER2 + c4
    assert trained_tokens(compacted) == c3 + c4
    assert redrift.turns == [4] and trained_tokens(redrift) == c2 and redrift.tokens[: len(SYS + USER)] == SYS + USER


def test_a_retry_branches_and_the_branches_share_their_prefix_in_the_packer():
    c1, bad, good = [100, 199], [120, 121, 199], [130, 199]
    turns = [
        turn(SYS + USER, c1),
        turn(SYS + USER + c1 + TOOL, bad),
        turn(SYS + USER + c1 + TOOL, good),  # the agent retried the same call
    ]
    main, retry = build_timelines(turns)
    assert trained_tokens(main) == c1 + bad and trained_tokens(retry) == good  # c1 trained once
    sequences = [Sequence(t.tokens, t.trained, t.old_logprobs, [1.0] * len(t.trained)) for t in (main, retry)]
    [packed] = pack(sequences, 4096)
    assert packed.size == unique_tokens([t.tokens for t in (main, retry)]) == len(main.tokens) + len(good)


def test_build_batch_trains_merged_timelines():
    c = [[100 + i, 199] for i in range(3)]
    group = []
    for k in range(4):
        history = SYS + USER + c[0] + TOOL
        turns = [turn(SYS + USER, c[0]), turn(history, c[1]), turn(history + c[1], c[2])]
        group.append(Trajectory(id=f"e{k}", task_id="t", turns=turns, reward=float(k % 2)))
    batch = build_batch([group])
    assert len(batch.sequences) == 4 and batch.trained_tokens == 4 * 6
    assert batch.call_tokens == 4 * call_tokens(group[0].turns)
    tree = pack(batch.sequences, 4096)
    assert sum(p.size for p in tree) == len(batch.sequences[0].tokens)  # identical siblings: one path
