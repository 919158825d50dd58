"""Prefix-shared packing: sequences that share a prefix compute it once.

A batch's sequences (merged timelines, see ``batching.timeline``) often begin with the same tokens:
the GRPO siblings of one task share its prompt, agents of one episode share a system prompt and a
document, retried branches share the conversation up to the retry. ``pack`` inserts the sequences
into a prefix tree (a trie of tokens) and flattens it into one row per micro-batch, each tree
node once, in depth-first order. The model runs on that row with

* position ids = each node's depth (its position in every sequence that passes through it), and
* attention that lets a node see exactly its ancestors and itself, computed one of two ways:
  - ``dense``: one forward pass with a tree mask (with depth-first order, node j is an ancestor
    of node i iff ``j <= i < end[j]``, ``end`` being one past j's subtree). N x N, and a custom
    mask takes attention off its fast kernels: for small trees.
  - ``segments``: the tree is cut into chains at its branch points; each chain runs as an
    ordinary causal pass continuing from its ancestors' keys and values (a KV cache that stays in
    the autograd graph, so gradients reach the shared prefix from every branch). The attention
    cost is what the tree needs, no more: for large trees.
  A single chain is plain causal attention either way.

So each node's hidden state is the one it has in any sequence that contains it, and each trained
token's log-probability (read at its parent node, for the token of the child on that sequence's
path) equals the unpacked computation's. A trained token is one *entry* (node, target token,
behaviour log-prob, advantage); siblings that sampled the same token at the same place give two
entries on one node, so the loss and its gradient are exactly the unpacked sum.

Tokens processed per micro-batch = nodes in its tree, close to the batch's unique tokens (a tree
that does not fit in ``budget`` nodes is split between micro-batches, which recompute the prefix
they share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from agentjet_server.learner.batch import Sequence

DENSE_TREE_MAX = 2048  # nodes; above it a tree mask costs more than running its chains separately


@dataclass
class Packed:
    """One micro-batch: a forest of token trees in depth-first order, and its trained entries."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1 for a root
    depth: list[int] = field(default_factory=list)
    entry_nodes: list[int] = field(default_factory=list)  # node whose output predicts the entry's token
    entry_targets: list[int] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)  # each entry's group in the batch
    teacher_logprobs: list[float] = field(default_factory=list)  # NaN where its sequence had none
    spans: list[tuple[int, int]] = field(default_factory=list)  # each sequence's entries, in order
    sequences: int = 0
    _children: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def new_nodes(self, tokens: list[int]) -> int:
        """Nodes that inserting ``tokens`` would add."""
        node = -1
        for i, token in enumerate(tokens):
            child = self._children.get((node, token))
            if child is None:
                return len(tokens) - i
            node = child
        return 0

    def insert(self, seq: Sequence) -> None:
        nodes = []
        node = -1
        for token in seq.tokens:
            child = self._children.get((node, token))
            if child is None:
                child = len(self.tokens)
                self._children[(node, token)] = child
                self.tokens.append(token)
                self.parents.append(node)
                self.depth.append(0 if node < 0 else self.depth[node] + 1)
            nodes.append(child)
            node = child
        first = len(self.entry_nodes)
        for p in seq.positions:
            if p < 1:
                raise ValueError("a sequence's first token cannot be trained: nothing predicts it")
            self.entry_nodes.append(nodes[p - 1])
            self.entry_targets.append(seq.tokens[p])
        self.old_logprobs.extend(seq.old_logprobs)
        self.advantages.extend(seq.advantages)
        self.versions.extend(seq.versions)
        self.rewards.extend(seq.rewards)
        self.weights.extend(seq.weights)
        self.groups.extend([seq.group] * len(seq.positions))
        self.teacher_logprobs.extend(seq.teacher_logprobs or [math.nan] * len(seq.positions))
        self.spans.append((first, len(self.entry_nodes)))
        self.sequences += 1

    def segments(self) -> list[tuple[int, int, int]]:
        """The tree cut into chains at branch points: ``(start, end, parent segment or -1)``,
        node ranges in depth-first order; a segment's parent ends at its first node's parent."""
        children = [0] * self.size
        for p in self.parents:
            if p >= 0:
                children[p] += 1
        out: list[tuple[int, int, int]] = []
        segment_of = [0] * self.size
        for i, p in enumerate(self.parents):
            if i == 0 or p != i - 1 or children[p] > 1:
                out.append((i, i + 1, segment_of[p] if p >= 0 else -1))
            else:
                start, _, parent = out[-1]
                out[-1] = (start, i + 1, parent)
            segment_of[i] = len(out) - 1
        return out

    @property
    def is_chain(self) -> bool:
        """One unbranched sequence: ordinary causal attention does."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def subtree_ends(self) -> list[int]:
        end = list(range(1, self.size + 1))
        for i in range(self.size - 1, -1, -1):  # children come after their parent
            p = self.parents[i]
            if p >= 0:
                end[p] = max(end[p], end[i])
        return end

    def attention_mask(self) -> torch.Tensor | None:
        """``[1, 1, N, N]`` bool, True where node i may attend to node j; None for a chain."""
        if self.is_chain:
            return None
        idx = torch.arange(self.size)
        end = torch.tensor(self.subtree_ends())
        allowed = (idx[None, :] <= idx[:, None]) & (idx[:, None] < end[None, :])
        return allowed[None, None]

    def tensors(self, device: torch.device | str, tree_attention: str = "auto") -> MicroBatch:
        """What the learner's forward pass takes. ``tree_attention``: ``dense``, ``segments`` or
        ``auto`` (dense up to ``DENSE_TREE_MAX`` nodes)."""
        mode = tree_attention if tree_attention != "auto" else ("dense" if self.size <= DENSE_TREE_MAX else "segments")
        mask = self.attention_mask() if mode == "dense" else None
        segments = self.segments() if mode == "segments" and not self.is_chain else None

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        return MicroBatch(
            input_ids=torch.tensor([self.tokens], device=device),
            position_ids=torch.tensor([self.depth], device=device),
            attention_mask=mask.to(device) if mask is not None else None,
            segments=segments,
            entry_nodes=torch.tensor(self.entry_nodes, dtype=torch.long, device=device),
            targets=torch.tensor(self.entry_targets, dtype=torch.long, device=device),
            old_logprobs=floats(self.old_logprobs),
            advantages=floats(self.advantages),
            versions=torch.tensor(self.versions, dtype=torch.long, device=device),
            rewards=floats(self.rewards),
            weights=floats(self.weights),
            groups=torch.tensor(self.groups, dtype=torch.long, device=device),
            spans=list(self.spans),
            teacher_logprobs=floats(self.teacher_logprobs),
        )


@dataclass
class MicroBatch:
    """One packed micro-batch as tensors: the tree's tokens (one row), its positions and attention
    (a mask, chain segments, or neither for a plain chain), and one entry per trained token.
    The learner fills the optional ones before its update (``learner.prepare``) or in it."""

    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N]
    attention_mask: torch.Tensor | None  # [1, 1, N, N] bool
    segments: list[tuple[int, int, int]] | None
    entry_nodes: torch.Tensor  # [E] the node whose output predicts the entry's token
    targets: torch.Tensor  # [E]
    old_logprobs: torch.Tensor  # [E] behaviour log-probs (what the engine sampled with)
    advantages: torch.Tensor  # [E]
    versions: torch.Tensor  # [E] policy version that sampled each entry, -1 unknown
    rewards: torch.Tensor  # [E] rewards arriving with each entry (PPO)
    weights: torch.Tensor  # [E] loss weight (staleness down-weighting)
    groups: torch.Tensor  # [E] the entry's group in the batch
    spans: list[tuple[int, int]]  # each sequence's entries, in order
    proximal_logprobs: torch.Tensor | None = None
    reference_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None  # [E] a remote teacher's (NaN: not scored)
    # [E] the trainer's log-probs at the weights about to be updated (pi_old): from the no-gradient pass, or
    # kept from the update's first forward where that ran before any optimizer step (``fresh``)
    trainer_logprobs: torch.Tensor | None = None
    fresh: bool = False  # this forward runs at the weights the step started from

    @property
    def entries(self) -> int:
        return int(self.targets.numel())


def pack(sequences: list[Sequence], budget: int) -> list[Packed]:
    """Pack ``sequences`` into prefix trees of at most ``budget`` nodes each (a longer sequence
    gets a micro-batch of its own). Sorting the sequences puts those that share a prefix next to
    each other and makes insertion order a depth-first order."""
    out: list[Packed] = []
    current = Packed()
    for seq in sorted(sequences, key=lambda s: s.tokens):
        if current.sequences and current.size + current.new_nodes(seq.tokens) > budget:
            out.append(current)
            current = Packed()
        current.insert(seq)
    if current.sequences:
        out.append(current)
    return out


def unique_tokens(sequences: list[list[int]]) -> int:
    """Nodes of the prefix tree of ``sequences``: the floor of tokens any exact trainer processes."""
    tree = Packed()
    for tokens in sorted(sequences):
        tree.insert(Sequence(tokens, [], [], []))
    return tree.size


@dataclass
class MiniBatch:
    """One optimizer step's share of the batch on this rank: its micro-batches (``None`` where
    this rank only joins the other ranks' collectives), and every rank's trained tokens and sequences
    together (the loss's normalisers)."""

    micro: list[MicroBatch | None]
    tokens: float
    sequences: float = 1.0
