"""Two learner steps on a fixed batch, run under torchrun; rank 0 saves the weights.

    torchrun --nproc_per_node 2 tests/server/learner/dist_step.py --model DIR --out W.safetensors [--resume-at 1]
    torchrun ... dist_step.py --model DIR --runs '[["A.safetensors", ["--algorithm", "ppo"]], ...]'

Used by test_distributed.py to compare a sharded step with a single-process one. ``--runs`` runs several
settings one after the other in one launch (one process group; each run starts from the same seed and a
fresh model), which saves a launch (and the imports) per setting.
"""

from __future__ import annotations

import argparse
import json
import random

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from agentjet_client.protocol import Trajectory, Turn
from agentjet_server.learner import distributed
from agentjet_server.learner.batch import Batch, Sequence, build_batch
from agentjet_server.learner.trainer import Learner, LearnerConfig


def behaviour_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> list[float]:
    """What the engine would have reported: the model's own log-probabilities of the completion."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)
    return logp.tolist()


def fixed_groups(model: torch.nn.Module, groups: int, size: int, seed: int = 0) -> list[list[Trajectory]]:
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 40))]
        group = []
        for i in range(size):
            turns = []
            for _ in range(rng.randint(1, 2)):
                completion = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
                logprobs = behaviour_logprobs(model, prompt, completion)
                turns.append(
                    Turn(
                        policy_version=0,
                        prompt_token_ids=prompt,
                        completion_token_ids=completion,
                        completion_logprobs=logprobs,
                        finish_reason="stop",
                    )
                )
            group.append(Trajectory(id=f"{g}-{i}", task_id=f"t{g}", turns=turns, reward=float(rng.random() < 0.5)))
        out.append(group)
    return out


def preference_batch(groups: list[list[Trajectory]]) -> Batch:
    """DPO pairs from the groups (siblings two by two, on their first turn), with references that give
    margins of both signs, at a learning rate of their own (which must reach every rank)."""
    sequences = []
    for group in groups:
        for k in range(0, len(group) - 1, 2):
            for j, trajectory in enumerate(group[k : k + 2]):
                turn = trajectory.turns[0]
                n = len(turn.completion_token_ids)
                reference = sum(turn.completion_logprobs) + (0.4 if j == 0 else -0.2) * (k - 1)
                tokens = list(turn.prompt_token_ids) + list(turn.completion_token_ids)
                sequence = Sequence.single(tokens, len(turn.prompt_token_ids), [reference / n] * n, 0.0)
                sequence.group = len(sequences)
                sequences.append(sequence)
    return Batch(sequences, [], len(sequences) // 2, 0, len(sequences) // 2, mode="dpo", lr=3e-3, beta=0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out")
    parser.add_argument("--runs", help="JSON: [[out, [arguments...]], ...], each a run of its own")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--entropy-coef", type=float, default=0.0)
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    parser.add_argument("--tree-attention", default="auto", help="dense | segments | auto")
    parser.add_argument("--off-policy", default="decoupled", help="decoupled | tis | none")
    parser.add_argument("--algorithm", default="grpo", help="grpo | ppo")
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--mini-batches", type=int, default=1)
    parser.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPU offload (one process too)")
    parser.add_argument("--policy-loss", default="ppo", help="ppo | gspo | cispo | sapo | importance_sampling | dro")
    parser.add_argument("--loss-aggregation", default="token-mean")
    parser.add_argument("--mode", default="rl", help="rl | dpo (pairs of the same groups, scored first)")
    parser.add_argument("--resume-at", type=int, default=0, help="save + reload state before this step")
    args = parser.parse_args()
    ctx = distributed.init_from_env(args.device)
    if args.runs:
        runs = [
            parser.parse_args(["--model", args.model, "--out", out, *extra]) for out, extra in json.loads(args.runs)
        ]
    else:
        runs = [args]
    reports = [run(ctx, one) for one in runs]
    if ctx.is_main:
        print(json.dumps({"world_size": ctx.world_size, "runs": reports}), flush=True)
    distributed.shutdown(ctx)


def run(ctx: distributed.DistContext, args: argparse.Namespace) -> list[dict[str, float]]:
    """One setting's steps from seed 0 and a fresh model; rank 0 saves the weights and gradients to
    ``args.out``; the steps' figures."""
    torch.manual_seed(0)
    if ctx.device == "cpu":
        torch.use_deterministic_algorithms(True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = LearnerConfig(
        lr=1e-3,
        micro_batch_tokens=args.micro_batch_tokens,
        entropy_coef=args.entropy_coef,
        tree_attention=args.tree_attention,
        off_policy=args.off_policy,
        algorithm=args.algorithm,
        kl_coef=args.kl_coef,
        mini_batches=args.mini_batches,
        cpu_offload=args.cpu_offload,
        policy_loss=args.policy_loss,
        loss_aggregation=args.loss_aggregation,
        loss_norm_length=8,
    )
    groups = [fixed_groups(model, args.groups, 5, seed=step) for step in range(args.steps)]
    if args.mode == "dpo":
        batches = [preference_batch(g) for g in groups]
    else:
        batches = [build_batch(g, algorithm=args.algorithm) for g in groups]

    def reference() -> torch.nn.Module | None:
        if not args.kl_coef:
            return None
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(ctx.device)

    learner = Learner(model.to(ctx.device), config, pad_id=0, ctx=ctx, reference=reference())
    stats = []
    for i, batch in enumerate(batches):
        if args.resume_at and i == args.resume_at:  # what a checkpoint + --resume does, in memory
            state = learner.training_state()
            fresh = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
            learner = Learner(fresh.to(ctx.device), config, pad_id=0, ctx=ctx, reference=reference())
            learner.load_training_state(state if ctx.is_main else None)
        scored = {"scored": float(learner.score(batch).sum())} if args.mode == "dpo" else {}
        s = learner.step(batch)
        stats.append({"loss": s.loss, "grad_norm": s.grad_norm, "sequences": s.sequences, **s.extra, **scored})
    weights = learner.full_state_dict()
    if learner.policy.value_head is not None:  # PPO: the critic, gathered the same way
        critic = distributed.full_state_dict(learner.policy.value_head, ctx)
        weights.update({f"critic.{k}": v for k, v in critic.items()})
    grads = {}  # the last step's (clipped) gradients, gathered like the weights
    for name, param in learner.model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads["grad." + name] = grad.detach().cpu().clone()
    if ctx.is_main:
        save_file({k: v.contiguous() for k, v in {**weights, **grads}.items()}, args.out)
    del learner, model, weights, grads, batches  # nothing refers to the process group any more
    return stats


if __name__ == "__main__":
    main()
