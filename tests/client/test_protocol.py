import math

import pytest
from pydantic import ValidationError

from agentjet_client.protocol import ChatCompletionRequest, Trajectory, TrajectoryBatch, Turn


def turn(**kw):
    base = dict(
        policy_version=0,
        prompt_token_ids=[1, 2],
        completion_token_ids=[3, 4],
        completion_logprobs=[-0.1, -0.2],
        finish_reason="stop",
    )
    base.update(kw)
    return Turn(**base)


def test_turn_needs_one_logprob_per_token():
    with pytest.raises(ValidationError, match="one log-probability per completion token"):
        turn(completion_logprobs=[-0.1])


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.5])
def test_turn_rejects_non_logprobs(bad):
    with pytest.raises(ValidationError, match="finite log-probabilities"):
        turn(completion_logprobs=[-0.1, bad])


def test_trajectory_rejects_nan_reward_and_unknown_fields():
    with pytest.raises(ValidationError, match="finite"):
        Trajectory(id="a", task_id="t", turns=[turn()], reward=math.nan)
    with pytest.raises(ValidationError, match="extra"):
        Trajectory.model_validate({"id": "a", "task_id": "t", "turns": [], "status": "failed", "rewrad": 1})


def test_complete_trajectory_needs_turns_and_oldest_version_uses_token_versions():
    with pytest.raises(ValidationError, match="at least one turn"):
        Trajectory(id="a", task_id="t", turns=[], reward=1.0)
    t = Trajectory(
        id="a",
        task_id="t",
        turns=[turn(policy_version=5, completion_versions=[5, 6]), turn(policy_version=7)],
        reward=1.0,
    )
    assert t.oldest_version == 5


def test_batch_bounds():
    with pytest.raises(ValidationError):
        TrajectoryBatch(trajectories=[])


def test_chat_request_strict_and_limits():
    ok = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "max_completion_tokens": 5}
    )
    assert ok.completion_limit(100) == 5
    assert (
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]}).completion_limit(7) == 7
    )
    with pytest.raises(ValidationError, match="extra"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "temprature": 1})
    with pytest.raises(ValidationError, match="presence_penalty"):  # OpenAI's bounds, [-2, 2]
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5})
    with pytest.raises(ValidationError, match="not in tools"):
        ChatCompletionRequest.model_validate(
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            }
        )


def test_an_error_answer_gives_its_message_and_anything_else_its_start():
    from agentjet_client.protocol import ErrorResponse

    body = '{"error": {"message": "max_tokens is 9000", "type": "invalid_request_error", "param": "max_tokens"}}'
    assert ErrorResponse.message_of(body) == "max_tokens is 9000"
    assert ErrorResponse.message_of("<html>502 Bad Gateway</html>") == "<html>502 Bad Gateway</html>"
    assert ErrorResponse.message_of('{"detail": "x"}' + " " * 600) == '{"detail": "x"}' + " " * 485
