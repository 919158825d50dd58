"""A GRPO group of the ten digit answers to one prompt, with the tiny model's own log-probs."""

from __future__ import annotations

import torch

from agentjet_client.protocol import Trajectory, Turn


def make_group(tok, model, prompt, right, step):
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    end = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
    group = []
    for d in range(10):
        tid = tok.convert_tokens_to_ids(str(d))
        turn = Turn(
            policy_version=0,
            prompt_token_ids=ids,
            completion_token_ids=[tid, end],
            completion_logprobs=[float(logp[tid]), -1e-3],
            finish_reason="stop",
        )
        group.append(Trajectory(id=f"{step}-{d}", task_id=prompt, turns=[turn], reward=float(d == right)))
    return ids, group


def _turn(prompt: list[int], completion: list[int], versions: list[int], reward: float | None = None) -> Turn:
    return Turn(
        policy_version=min(versions),
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=[-1.0] * len(completion),
        completion_versions=versions,
        finish_reason="stop",
        reward=reward,
    )


def _mini(micro):
    from agentjet_server.learner.trainer import MiniBatch

    return MiniBatch([micro], float(micro.entries))
