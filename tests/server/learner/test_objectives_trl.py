"""Each policy loss and aggregation that TRL's GRPOTrainer also implements gives TRL's loss and gradient on the
same model, tokens, old log-probs and advantages (TRL's own ``_compute_loss``): its ``loss_type`` grpo, bnpo,
dr_grpo, dapo, cispo and sapo, and ``importance_sampling_level="sequence"`` (GSPO)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agentjet_server.learner.batch import Sequence
from agentjet_server.learner.config import LearnerConfig
from agentjet_server.learner.objective import objective
from agentjet_server.learner.packing import pack
from agentjet_server.learner.policy import PolicyModel

PROMPT = [11, 12, 13, 14, 15]
COMPLETIONS = [[21, 22, 23], [24, 25, 26, 27], [28, 29], [30, 31, 32, 33]]
ADVANTAGES = [1.0, -0.5, 0.8, -1.2]
LONGEST = 4

CASES = {
    "grpo": ({"loss_type": "grpo"}, {"loss_aggregation": "seq-mean-token-mean"}),
    "bnpo": ({"loss_type": "bnpo"}, {"loss_aggregation": "token-mean"}),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {"loss_aggregation": "seq-mean-token-sum-norm", "loss_norm_length": LONGEST}),
    "dapo": ({"loss_type": "dapo"}, {"loss_aggregation": "token-mean"}),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.3}, {"policy_loss": "cispo", "cispo_cap": 1.3}),
    "sapo": ({"loss_type": "sapo"}, {"policy_loss": "sapo", "loss_aggregation": "seq-mean-token-mean"}),
    "gspo": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.05, "epsilon_high": 0.08},
        {"policy_loss": "gspo", "loss_aggregation": "seq-mean-token-mean", "clip_low": 0.05, "clip_high": 0.08},
    ),
}


def old_logprobs(model: Any) -> list[list[float]]:
    """The model's own log-probs of each completion, moved by fixed amounts so that ratios differ from 1 (some
    past the clip)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    with torch.no_grad():
        for completion in COMPLETIONS:
            ids = torch.tensor([PROMPT + completion])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            own = [float(logp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(completion)]
            out.append([x + float(torch.randn((), generator=generator)) * 0.3 for x in own])
    return out


def trl_loss_and_grads(model_dir: Any, trl_args: dict[str, Any], old: list[list[float]]) -> tuple[float, dict]:  # type: ignore[type-arg]
    import tempfile

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with tempfile.TemporaryDirectory() as out:
        args = {"epsilon": 0.2, "epsilon_high": 0.28, **trl_args}
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=LONGEST,
            temperature=1.0,
            beta=0.0,
            use_cpu=True,
            report_to=[],
            gradient_checkpointing=False,
            bf16=False,  # both sides in fp32 (TRL's default computes under bf16 autocast)
            **args,
        )
        rows = Dataset.from_list([{"prompt": "x"}] * 4)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=config,
            train_dataset=rows,
            processing_class=AutoTokenizer.from_pretrained(str(model_dir)),
        )
        trainer.current_gradient_accumulation_steps = 1
        completion_ids = torch.tensor([c + [0] * (LONGEST - len(c)) for c in COMPLETIONS])
        completion_mask = torch.tensor([[1] * len(c) + [0] * (LONGEST - len(c)) for c in COMPLETIONS])
        inputs = {
            "prompt_ids": torch.tensor([PROMPT] * 4),
            "prompt_mask": torch.ones(4, len(PROMPT), dtype=torch.long),
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": torch.tensor(ADVANTAGES),
            "old_per_token_logps": torch.tensor([o + [0.0] * (LONGEST - len(o)) for o in old]),
            "num_items_in_batch": completion_mask.sum(),
        }
        model.train()
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def our_loss_and_grads(model_dir: Any, ours: dict[str, Any], old: list[list[float]]) -> tuple[float, dict]:  # type: ignore[type-arg]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    config = LearnerConfig(off_policy="none", **ours)
    sequences = [
        Sequence(PROMPT + c, list(range(len(PROMPT), len(PROMPT) + len(c))), o, [a] * len(c))
        for c, o, a in zip(COMPLETIONS, old, ADVANTAGES, strict=True)
    ]
    for number, sequence in enumerate(sequences):
        sequence.group = number
    [micro] = [p.tensors("cpu") for p in pack(sequences, 4096)]
    policy = PolicyModel(model)
    policy.train()
    loss, _ = objective(config, policy, micro, float(micro.entries), "rl", None, float(len(sequences)))
    loss.backward()
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", list(CASES))
def test_the_loss_and_its_gradient_equal_trls(model_dir, case):
    from transformers import AutoModelForCausalLM

    trl_args, ours = CASES[case]
    old = old_logprobs(AutoModelForCausalLM.from_pretrained(str(model_dir)))
    theirs, their_grads = trl_loss_and_grads(model_dir, trl_args, old)
    mine, my_grads = our_loss_and_grads(model_dir, ours, old)
    assert mine == pytest.approx(theirs, rel=1e-4, abs=1e-6), (mine, theirs)
    assert set(my_grads) == set(their_grads)
    for name, grad in my_grads.items():
        assert torch.allclose(grad, their_grads[name], rtol=1e-3, atol=1e-6), name
    assert any(float(g.abs().max()) > 0 for g in my_grads.values())
