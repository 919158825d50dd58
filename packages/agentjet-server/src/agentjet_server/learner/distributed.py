"""The learner across processes: torch.distributed with FSDP2, under torchrun.

    torchrun --nproc_per_node 2 -m agentjet_server up --model PATH      # 2 learner ranks
    agentjet-server up --model PATH                                      # 1 process, same code

Every rank holds a shard of the trainable model (``fully_shard`` on each decoder layer and on
the policy wrapper as root); gloo on CPU, NCCL on GPU. Rank 0 also serves HTTP and runs the
engine. When rank 0 has a batch it broadcasts it; each rank trains on its share of the
sequences (balanced by tokens), gradients are averaged across ranks by FSDP's reduce-scatter (each
rank scales its loss by the world size, so the average is the whole batch's gradient), and
one optimizer step follows on every shard. The full weights are gathered once per step, to
rank 0 only, for the engine. Ranks other than 0 run ``loop.worker_loop`` and nothing else.
This module is a leaf: torch collectives and sharding, no knowledge of the learner.

With one process (no ``WORLD_SIZE`` in the environment, or ``WORLD_SIZE=1``) no process
group is created and none of this costs anything.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch

from agentjet_server.errors import ConfigError

T = TypeVar("T")

logger = logging.getLogger(__name__)

# rank 0 sends one of these (or a Batch) to every other rank
STOP = "stop"
IDLE = "idle"
CHECKPOINT = "checkpoint"
HEARTBEAT_SECONDS = 30.0


@dataclass(frozen=True)
class Reconfigure:
    """Rank 0's learner settings changed (admin API): every rank takes them before the next step."""

    config: object  # a LearnerConfig


@dataclass(frozen=True)
class Score:
    """Rank 0 scores a batch without updating anything (a held-out loss, DPO's reference log-probs): every
    rank runs its share of the forward passes."""

    batch: object  # a Batch
    adapter: str | None = None


@dataclass(frozen=True)
class PublishWeights:
    """Rank 0 publishes new weights to the engine replicas on other ranks (``--remote-replica-ranks``):
    their names, shapes and dtypes; the tensors follow by broadcast in the replicas' group."""

    version: int
    specs: tuple[tuple[str, tuple[int, ...], str], ...]


@dataclass
class ReplicaRanks:
    """The ranks that host an engine replica, their process group with rank 0, and (rank 0) where each
    replica is served, or (a host rank) this rank's replica."""

    ranks: tuple[int, ...]
    group: Any  # a torch.distributed ProcessGroup
    authkey: bytes
    addresses: list[tuple[str, int]]
    host: object = None  # a ReplicaHost on a host rank


BUCKET_BYTES = 256 << 20  # weights cross in flat buffers of at most this many bytes


# on GPUs, NCCL for the model's tensors and gloo for the few CPU tensors the learner reduces
CUDA_BACKEND = "cpu:gloo,cuda:nccl"


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the learner group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    enabled: bool = field(init=False)  # several ranks: collectives to take part in
    is_main: bool = field(init=False)  # rank 0: the one that serves, logs and checkpoints

    def __post_init__(self) -> None:
        object.__setattr__(self, "enabled", self.world_size > 1)
        object.__setattr__(self, "is_main", self.rank == 0)


def init_from_env(
    device: str = "cpu", timeout: timedelta = timedelta(minutes=30), devices: list[str] | None = None
) -> DistContext:
    """Join the process group torchrun describes in the environment (or none, alone).

    ``device`` is the user's choice (``cpu`` or ``cuda``); under torchrun on GPU each rank takes
    ``cuda:<LOCAL_RANK>``. ``devices`` (``--learner-devices``) names each local rank's device instead.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if devices:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= len(devices):
            raise ConfigError(
                f"--learner-devices names {len(devices)} device(s) but this is local rank {local}: "
                "name one device per process torchrun starts on this machine"
            )
        device = devices[local]
    if world <= 1:
        if device.startswith("cuda") and ":" in device:
            torch.cuda.set_device(device)
        return DistContext(device=device)
    missing = [name for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={world} is set but {', '.join(missing)} is not: start the server with "
            "`torchrun --nproc_per_node N -m agentjet_server up ...`, or unset WORLD_SIZE for one process"
        )
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    import torch.distributed as dist

    if device.startswith("cuda"):
        device = device if devices else f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        # NCCL for the model's tensors; gloo for the learner's small CPU-side reductions (advantage
        # statistics, flags), which NCCL alone refuses ("no backend for device type cpu")
        backend = CUDA_BACKEND
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    logger.info("learner rank %d of %d on %s (%s)", rank, world, device, backend)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device)


def shard_model(
    policy: torch.nn.Module, layers: list[torch.nn.Module], ctx: DistContext, offload: bool = False
) -> bool:
    """FSDP2: one unit per decoder layer, the rest (embeddings, final norm, head) in the root. With
    ``offload`` (``--cpu-offload``) each unit's shard, its gradients and so the optimizer step live in
    host memory, and the unit is gathered onto ``ctx.device`` to compute it; alone (one process)
    that needs a process group of one. Returns whether the model is sharded."""
    if not ctx.enabled and not offload:
        return False
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    on_gpu = ctx.device.startswith("cuda")
    if not dist.is_initialized():  # one process: a group of one, nothing on the network
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(CUDA_BACKEND if on_gpu else "gloo", store=store, rank=0, world_size=1)
    mesh = init_device_mesh("cuda" if on_gpu else "cpu", (ctx.world_size,))
    # pinned host memory: the copies to and from the device overlap compute
    policy_ = CPUOffloadPolicy(pin_memory=on_gpu) if offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy_)
    fully_shard(policy, mesh=mesh, offload_policy=policy_)
    return True


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (``_no_split_modules`` names their class)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # not a transformers model: every entry of every ModuleList
        for lst in model.modules():
            if isinstance(lst, torch.nn.ModuleList):
                layers.extend(lst)
    return layers


def full_state_dict(model: torch.nn.Module, ctx: DistContext) -> dict[str, torch.Tensor]:
    """Full weights on CPU; collective under FSDP (every rank calls it), returned on rank 0 only."""
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        if ctx.is_main:
            out[name] = full.detach().to("cpu", copy=True)
    return out


def partition(items: list[T], world_size: int, size: Callable[[T], int]) -> list[list[T]]:
    """Split items (micro-batches) over ranks, balancing ``size`` (largest first onto the lightest
    rank). Every rank computes the same split from the same batch, so nothing about it is sent."""
    shares: list[list[T]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for item in sorted(items, key=size, reverse=True):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        shares[rank].append(item)
        load[rank] += size(item)
    return shares


def broadcast(ctx: DistContext, message: object) -> object:
    """Rank 0's ``message`` on every rank."""
    import torch.distributed as dist

    box = [message if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown(ctx: DistContext, wait_for_others: bool = True) -> None:
    """Leave the process group cleanly: wait until every rank is done with its collectives (not
    when this rank is failing: the others may never arrive), free
    what still refers to the group (sharded tensors, the device mesh) while the interpreter is
    whole, then destroy it. A process group (and gloo's worker threads holding tensors) left for
    interpreter finalization can abort the process after its work is done ("terminate called
    without an active exception"). A process group of one (``--cpu-offload`` alone) is just
    destroyed."""
    import gc

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if not ctx.enabled:
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
        return
    try:
        if not wait_for_others:
            pass
        elif dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=120))  # names a rank that never arrives
        else:
            dist.barrier()
    except RuntimeError as exc:  # a rank died: leave anyway
        logger.warning("learner rank %d: not every rank reached shutdown: %s", ctx.rank, exc)
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def replica_ranks(ctx: DistContext, ranks: tuple[int, ...], start_host: Callable[[bytes], object]) -> ReplicaRanks:
    """(every rank, collectively) The process group of rank 0 and the replica ranks; each of those
    starts its replica (``start_host(authkey)``, an object with an ``address``), and rank 0 learns where
    they listen. The key that guards the replicas' connections comes from rank 0."""
    import secrets

    import torch.distributed as dist

    bad = [r for r in ranks if not 0 < r < ctx.world_size]
    if bad:
        raise ConfigError(
            f"--remote-replica-ranks {','.join(map(str, ranks))}: rank(s) {bad} are not other ranks of this job "
            f"(1 to {ctx.world_size - 1}); name ranks on the other machines, e.g. the first of each"
        )
    group = dist.new_group([0, *ranks])  # every rank takes part in making it
    box: list[object] = [secrets.token_bytes(32) if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    authkey = box[0]
    assert isinstance(authkey, bytes)
    host = start_host(authkey) if ctx.rank in ranks else None
    addresses: list[object] = [None] * ctx.world_size
    dist.all_gather_object(addresses, getattr(host, "address", None))
    found = [addresses[r] for r in ranks]
    return ReplicaRanks(ranks, group, authkey, [a for a in found if isinstance(a, tuple)], host)


def send_weights(ctx: DistContext, replicas: ReplicaRanks, weights: dict[str, torch.Tensor], version: int) -> None:
    """(rank 0) ``weights`` at ``version`` to every replica rank; returns once each has loaded them
    (EngineError-like RuntimeError if one could not)."""
    import torch.distributed as dist

    specs = tuple((name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in weights.items())
    broadcast(ctx, PublishWeights(version, specs))
    for bucket in _buckets(specs):
        flat = torch.cat([weights[name].detach().reshape(-1).to("cpu") for name, _, _ in bucket])
        dist.broadcast(flat, src=0, group=replicas.group)
    ok = torch.ones(1)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=replicas.group)
    if ok.item() < 1:
        raise RuntimeError(f"an engine replica on another rank could not load the weights of v{version}")


def receive_weights(ctx: DistContext, replicas: ReplicaRanks, message: PublishWeights) -> dict[str, torch.Tensor]:
    """(a replica rank) The tensors rank 0 broadcasts after ``message``."""
    import torch.distributed as dist

    out: dict[str, torch.Tensor] = {}
    for bucket in _buckets(message.specs):
        dtype = getattr(torch, bucket[0][2])
        flat = torch.empty(sum(_numel(shape) for _, shape, _ in bucket), dtype=dtype)
        dist.broadcast(flat, src=0, group=replicas.group)
        offset = 0
        for name, shape, _ in bucket:
            out[name] = flat[offset : offset + _numel(shape)].view(shape)
            offset += _numel(shape)
    return out


def acknowledge(replicas: ReplicaRanks, ok: bool) -> None:
    """(a replica rank) Whether this rank's replica loaded the weights (rank 0 waits for every rank's)."""
    import torch.distributed as dist

    flag = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=replicas.group)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _buckets(
    specs: tuple[tuple[str, tuple[int, ...], str], ...],
) -> list[list[tuple[str, tuple[int, ...], str]]]:
    """Consecutive tensors of one dtype, up to ``BUCKET_BYTES`` each (a larger tensor alone)."""
    buckets: list[list[tuple[str, tuple[int, ...], str]]] = []
    size = 0
    for spec in specs:
        nbytes = _numel(spec[1]) * torch.empty(0, dtype=getattr(torch, spec[2])).element_size()
        if not buckets or buckets[-1][0][2] != spec[2] or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(spec)
        size += nbytes
    return buckets
