"""Run by test_remote_replicas.py under torchrun (2 gloo processes): an engine replica hosted by rank 1, served
to rank 0 over TCP, its weights published by broadcast. Rank 0 prints one JSON line: for each published
version, the versions and greedy tokens of its own engine and of rank 1's replica."""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import torch
from safetensors.torch import load_file

from agentjet_server.engine.base import EngineOptions, SamplingParams
from agentjet_server.engine.hf import TransformersEngine
from agentjet_server.engine.remote_replicas import RemoteEngine, RemoteReplicas, ReplicaHost
from agentjet_server.learner import distributed
from agentjet_server.learner.loop import worker_loop

PROMPT = [{"role": "user", "content": "Write seven as a digit."}]


async def greedy(engine, prompt: list[int]) -> tuple[list[int], list[int]]:  # type: ignore[no-untyped-def]
    tokens, versions = [], []
    async for event in engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0)):
        tokens.append(event.token_id)
        versions.append(event.version)
    return tokens, versions


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    ctx = distributed.init_from_env("cpu")

    def start_host(authkey: bytes) -> ReplicaHost:
        return ReplicaHost(
            "transformers",
            args.model,
            authkey,
            os.environ["MASTER_ADDR"],
            model_name="agentjet-tiny",
            device="cpu",
            max_batch=8,
        )

    replicas = distributed.replica_ranks(ctx, (1,), start_host)
    if not ctx.is_main:  # the replica rank: what `up` runs on it (no learner step comes)
        try:
            worker_loop(None, ctx, replicas=replicas)  # type: ignore[arg-type]
        finally:
            replicas.host.close()  # type: ignore[attr-defined]
        distributed.shutdown(ctx)
        return
    local = TransformersEngine(args.model, EngineOptions(model_name="agentjet-tiny"))
    remote = RemoteEngine(replicas.addresses[0], replicas.authkey, args.model, model_name="agentjet-tiny")
    engine = RemoteReplicas(local, [remote], publish=lambda w, v: distributed.send_weights(ctx, replicas, dict(w), v))
    base = load_file(os.path.join(args.model, "model.safetensors"))
    prompt = local.render(PROMPT)
    report = []
    generator = torch.Generator().manual_seed(0)
    for version in (1, 2, 3):
        weights = {
            k: v + 0.05 * version * torch.randn(v.shape, generator=generator, dtype=v.dtype) for k, v in base.items()
        }
        engine.update_weights(weights, version)
        mine, theirs = asyncio.run(greedy(local, prompt)), asyncio.run(greedy(remote, prompt))
        routed = asyncio.run(greedy(engine, prompt))
        report.append({"version": version, "engine": engine.version, "local": mine, "remote": theirs, "routed": routed})
    report_status = engine.replica_status()
    distributed.broadcast(ctx, distributed.STOP)
    engine.close()
    distributed.shutdown(ctx)
    print(json.dumps({"updates": report, "status": report_status}))


if __name__ == "__main__":
    main()
