"""Tokens per update and learner step time: one sample per call vs AgentJet's merge rule vs ours.

    python bench/context.py [--repeats 2]

Three workloads, built as chat transcripts (ChatML-like framing tokens around random content
tokens of the stated lengths), so that every call's prompt is what a chat template would render:

1. AppWorld-like: one agent, 25 turns; each turn a ~60-token tool call, then a 200-400-token
   observation; a GRPO pair of episodes on the same task (system prompt + task, 400 tokens).
2. Three agents discuss a shared 2,000-token document for 6 rounds (~100 tokens per message);
   each agent sees the document, its role, its own earlier messages and the others' (as user turns).
3. A GRPO group of 8 single-turn episodes sharing a 1,000-token prompt (100-300-token answers).

For each, the trainer's input is built three ways and run through the same learner step (the
embedded tiny model, CPU, fp32):
  (a) one sample per call: every call's prompt + completion, each its own forward pass;
  (b) AgentJet's published rule: a newer call absorbs an older one when its first messages equal
      the older call's messages; each surviving call is one sample, each its own forward pass;
  (c) ours: timelines merged by exact token prefix, packed as prefix trees (shared prefixes once).
"floor" is the number of unique tokens (nodes of the prefix tree of all calls). Reported: tokens
processed per update, the ratio to (a) and to the floor, and the learner step time (best of
``--repeats``).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from agentjet_client.protocol import Turn
from agentjet_server.batching.timeline import build_timelines
from agentjet_server.learner.batch import Batch, Sequence
from agentjet_server.learner.packing import pack, unique_tokens
from agentjet_server.learner.trainer import Learner, LearnerConfig

IM_START, IM_END, NL = 1, 2, 3
ROLE = {"system": 4, "user": 5, "assistant": 6, "tool": 7}


@dataclass
class Message:
    role: str
    content: list[int]


def render(messages: list[Message]) -> list[int]:
    out: list[int] = []
    for m in messages:
        out += [IM_START, ROLE[m.role], NL, *m.content, IM_END, NL]
    return [*out, IM_START, ROLE["assistant"], NL]  # the generation prompt


@dataclass
class Call:
    agent: str
    messages: list[Message]
    completion: list[int]  # content + the end-of-turn token the model sampled

    def turn(self) -> Turn:
        n = len(self.completion)
        return Turn(
            agent=self.agent,
            policy_version=0,
            prompt_token_ids=render(self.messages),
            completion_token_ids=self.completion,
            completion_logprobs=[-1.0] * n,
            finish_reason="stop",
        )


class Words:
    def __init__(self, seed: int, vocab: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def __call__(self, lo: int, hi: int | None = None) -> list[int]:
        n = lo if hi is None else self.rng.randint(lo, hi)
        return [self.rng.randrange(10, self.vocab) for _ in range(n)]


def appworld(words: Words, episodes: int = 2, turns: int = 25) -> list[list[Call]]:
    system, task = words(300), words(100)
    out = []
    for _ in range(episodes):
        messages = [Message("system", system), Message("user", task)]
        calls = []
        for _ in range(turns):
            content = words(40, 80)
            calls.append(Call("agent", list(messages), [*content, IM_END]))
            messages += [Message("assistant", content), Message("tool", words(200, 400))]
        out.append(calls)
    return out


def discussion(words: Words, agents: int = 3, rounds: int = 6) -> list[list[Call]]:
    document = words(2000)
    names = [f"agent{i}" for i in range(agents)]
    roles = {n: words(10) for n in names}
    said: list[tuple[str, list[int]]] = []
    calls = []
    for _ in range(rounds):
        for name in names:
            messages = [Message("system", document), Message("user", roles[name])]
            messages += [Message("assistant" if who == name else "user", text) for who, text in said]
            content = words(80, 120)
            calls.append(Call(name, messages, [*content, IM_END]))
            said.append((name, content))
    return [calls]  # one episode


def grpo_group(words: Words, size: int = 8) -> list[list[Call]]:
    prompt = [Message("system", words(200)), Message("user", words(800))]
    return [[Call("agent", prompt, [*words(100, 300), IM_END])] for _ in range(size)]


def per_call(episodes: list[list[Call]]) -> list[Sequence]:
    out = []
    for calls in episodes:
        for call in calls:
            t = call.turn()
            tokens = t.prompt_token_ids + t.completion_token_ids
            out.append(Sequence.single(tokens, len(t.prompt_token_ids), t.completion_logprobs, 1.0))
    return out


def agentjet_rule(episodes: list[list[Call]]) -> list[Sequence]:
    """A newer call absorbs an older one when its first messages equal the older call's messages;
    the absorbing call's sample trains the absorbed calls' completions where they sit in its prompt."""
    out = []
    for calls in episodes:
        absorbed_by: dict[int, int] = {}
        for i, older in enumerate(calls):
            for j in range(i + 1, len(calls)):
                newer = calls[j]
                if newer.agent == older.agent and newer.messages[: len(older.messages)] == older.messages:
                    absorbed_by[i] = j
                    break
        for j, call in enumerate(calls):
            if j in absorbed_by:
                continue
            members = [j]
            frontier = [j]
            while frontier:
                k = frontier.pop()
                kids = [i for i, target in absorbed_by.items() if target == k]
                members += kids
                frontier += kids
            t = call.turn()
            tokens = t.prompt_token_ids + t.completion_token_ids
            positions = list(range(len(t.prompt_token_ids), len(tokens)))
            for k in members[1:]:  # an absorbed call's completion, found where its prompt ends
                turn = calls[k].turn()
                start = len(turn.prompt_token_ids)
                if tokens[start : start + len(turn.completion_token_ids)] == turn.completion_token_ids:
                    positions += range(start, start + len(turn.completion_token_ids))
            positions = sorted(set(positions))
            out.append(Sequence(tokens, positions, [-1.0] * len(positions), [1.0] * len(positions)))
    return out


def ours(episodes: list[list[Call]]) -> list[Sequence]:
    out = []
    for calls in episodes:
        for timeline in build_timelines([c.turn() for c in calls]):
            n = len(timeline.trained)
            out.append(Sequence(timeline.tokens, timeline.trained, timeline.old_logprobs, [1.0] * n))
    return out


def step_seconds(learner: Learner, sequences: list[Sequence], share: bool, repeats: int) -> float:
    """One learner step; (a) and (b) run each sample as its own forward pass (no sharing)."""
    batch = Batch(sequences, [1.0], 1, 0, len(sequences))
    budget = learner.config.micro_batch_tokens if share else 1  # budget 1: one sequence per micro-batch
    config = learner.config
    learner.config = LearnerConfig(lr=config.lr, micro_batch_tokens=budget)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        learner.step(batch)
        best = min(best, time.perf_counter() - started)
    learner.config = config
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from agentjet_server.embedded import ensure_embedded_model

    path = ensure_embedded_model()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    learner = Learner(model, LearnerConfig(lr=1e-5), pad_id=0)
    vocab = model.config.vocab_size
    workloads = {
        "1 AppWorld-like, 25 turns": appworld(Words(1, vocab)),
        "2 three agents, 2k document, 6 rounds": discussion(Words(2, vocab)),
        "3 GRPO group of 8, 1k prompt": grpo_group(Words(3, vocab)),
    }
    rows = []
    for name, episodes in workloads.items():
        floor = unique_tokens([c.turn().prompt_token_ids + c.completion for calls in episodes for c in calls])
        results = {}
        for label, build, share in (("a", per_call, False), ("b", agentjet_rule, False), ("c", ours, True)):
            sequences = build(episodes)
            processed = sum(p.size for p in pack(sequences, learner.config.micro_batch_tokens if share else 1))
            trained = sum(len(s.positions) for s in sequences)
            print(f"{name} ({label}): {len(sequences)} samples, {processed} tokens, timing ...", flush=True)
            results[label] = (processed, trained, step_seconds(learner, sequences, share, args.repeats))
        rows.append((name, floor, results))
    print(
        "\n| workload | floor (unique tokens) | (a) per call | (b) AgentJet rule | (c) ours | (a)/(c) | (b)/(c) "
        "| (c)/floor | step (a) | step (b) | step (c) | step (a)/(c) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, floor, r in rows:
        a, b, c = (r[k][0] for k in "abc")
        ta, tb, tc = (r[k][2] for k in "abc")
        assert r["a"][1] == r["b"][1] == r["c"][1], "each variant must train the same sampled tokens"
        print(
            f"| {name} | {floor:,} | {a:,} | {b:,} | {c:,} | {a / c:.2f}x | {b / c:.2f}x | {c / floor:.3f} "
            f"| {ta:.2f}s | {tb:.2f}s | {tc:.2f}s | {ta / tc:.1f}x |"
        )


if __name__ == "__main__":
    main()
