"""A GRPO group of the ten digit answers to one prompt, with the tiny model's own log-probs."""

from __future__ import annotations

import torch

from agentjet_client.protocol import Trajectory, Turn


def make_group(tok, model, prompt, right, step, exact=False):
    """``exact``: each end token's sampled log-prob is the model's own, not the stand-in -1e-3 (rollout
    correction reads the sampler's log-probs against the trainer's)."""
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
            completion_logprobs=[float(logp[tid]), _end_logprob(model, [*ids, tid], end) if exact else -1e-3],
            finish_reason="stop",
        )
        group.append(Trajectory(id=f"{step}-{d}", task_id=prompt, turns=[turn], reward=float(d == right)))
    return ids, group


def _end_logprob(model, ids, end):
    with torch.no_grad():
        return float(torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)[end])


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


def micro_batch(behaviour, advantages, weights=None, spans=None, proximal=None, trainer=None):
    """A micro-batch of trained entries alone (the fields the policy terms read; the model's inputs are
    placeholders): the sampler's log-probs ``behaviour``, the ``advantages``, the loss ``weights`` (1), one
    sequence unless ``spans`` say otherwise, and the ``proximal`` and ``trainer`` (pi_old) log-probs."""
    from agentjet_server.learner.packing import MicroBatch

    n = behaviour.numel()
    return MicroBatch(
        input_ids=torch.zeros(1, n, dtype=torch.long),
        position_ids=torch.arange(n)[None],
        attention_mask=None,
        segments=None,
        entry_nodes=torch.arange(n),
        targets=torch.zeros(n, dtype=torch.long),
        old_logprobs=behaviour,
        advantages=advantages,
        versions=torch.full((n,), 3),
        rewards=torch.zeros(n),
        weights=torch.ones(n, dtype=behaviour.dtype) if weights is None else weights,
        groups=torch.zeros(n, dtype=torch.long),
        spans=[(0, n)] if spans is None else list(spans),
        proximal_logprobs=proximal,
        trainer_logprobs=trainer,
    )
