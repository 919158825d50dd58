"""The Tinker API (``/api/v1``) with the real ``tinker`` SDK (pinned 0.38) against a real server with the
embedded model: a LoRA training client learns, its log-probabilities agree with an independent recompute and
with its sampler, a sampler from its weights samples what it learned, a saved state continues as the original,
two clients interleave without touching each other, and bad input is a 4xx within a second."""

from __future__ import annotations

import time

import httpx2
import numpy as np
import pytest
import torch

from tests.conftest import LiveServer

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

assert tinker.__version__.startswith("0.38."), tinker.__version__
# the SDK's own connection pools (a sampling client's holder has one of its own) are never closed: its sockets'
# ResourceWarnings surface when the garbage collector finds them, in whichever test runs then
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning", "ignore::ResourceWarning")
MODEL = "agentjet-tiny"
TEXTS = [f"question {i}: what is {i} plus one? answer: {i + 1}" for i in range(8)]


@pytest.fixture(scope="module")
def server(model_dir):  # type: ignore[no-untyped-def]
    live = LiveServer(model_dir, api_keys=["client-key-1"], admin_keys=["admin-key-1"])
    yield live
    live.stop()


@pytest.fixture(scope="module")
def service(server):  # type: ignore[no-untyped-def]
    with tinker.ServiceClient(base_url=server.url, api_key="tml-client-key-1") as client:
        yield client


def data_of(tokenizer, texts=TEXTS) -> list:  # type: ignore[no-untyped-def,type-arg]
    out = []
    for text in texts:
        ids = tokenizer.encode(text)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    return out


def loss_per_token(client, data) -> float:  # type: ignore[no-untyped-def]
    out = client.forward(data, "cross_entropy").result()
    return out.metrics["loss:sum"] / sum(len(d.loss_fn_inputs["weights"].data) for d in data)


def step(client, data, lr: float = 1e-2) -> float:  # type: ignore[no-untyped-def]
    out = client.forward_backward(data, "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=lr)).result()
    return float(out.metrics["loss:sum"])


def test_a_lora_client_learns_and_its_logprobs_agree_with_a_recompute_and_its_sampler(service, server, tmp_path):
    client = service.create_lora_training_client(base_model=MODEL, rank=16, seed=0).result()
    tokenizer = client.get_tokenizer()  # from the model's directory: no hub
    data = data_of(tokenizer)
    before = loss_per_token(client, data)
    for _ in range(50):
        step(client, data, lr=1e-2)
    after = loss_per_token(client, data)
    assert after < before * 2 / 3, (before, after)  # rank 16 at 1e-2: falls by far more than a third

    # forward's log-probs = an independent recompute from the saved adapter (peft on a fresh base)
    path = client.save_weights_for_sampler(name="trained").result().path
    forward = client.forward(data[:2], "cross_entropy").result().loss_fn_outputs
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    directory = server.runtime.tinker.bench.checkpoints.directory(path)
    fresh = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(server.engine.model_path)), directory)
    for datum, out in zip(data[:2], forward, strict=True):
        ids = torch.tensor([datum.model_input.to_ints()])
        logp = torch.log_softmax(fresh(input_ids=ids).logits[0].float(), -1)
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
        recompute = logp.gather(1, targets[:, None])[:, 0].detach().numpy()
        assert np.abs(out["logprobs"].to_numpy() - recompute).max() < 2e-3

    # ... = the sampler's compute_logprobs on the saved weights
    sampler = service.create_sampling_client(model_path=path).result()
    ids = [*data[0].model_input.to_ints(), data[0].loss_fn_inputs["target_tokens"].data[-1]]
    prompt_logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    assert prompt_logprobs[0] is None
    assert np.abs(np.array(prompt_logprobs[1:]) - forward[0]["logprobs"].to_numpy()).max() < 2e-3

    # a sampler from the trained weights: tokens and log-probs align, and it says what it learned
    live = client.save_weights_and_get_sampling_client().result()
    full = tokenizer.encode(TEXTS[3])
    prompt = full[:-2]
    greedy = types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])
    trained = live.sample(types.ModelInput.from_ints(prompt), 2, greedy).result().sequences
    base = service.create_sampling_client(base_model=MODEL).result()
    untrained = base.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    assert trained[0].tokens == trained[1].tokens and untrained.tokens != trained[0].tokens
    taught = sum(live.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:])
    before = sum(base.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:])
    assert taught > before + 50, (taught, before)  # the sampler samples from what the client learned
    scored = live.compute_logprobs(types.ModelInput.from_ints(prompt + trained[0].tokens)).result()
    assert len(trained[0].logprobs) == len(trained[0].tokens) == 3
    assert np.allclose(scored[len(prompt) :], trained[0].logprobs, atol=2e-3)
    sampled = live.sample(types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=4, seed=1)).result()
    for seq in sampled.sequences:
        assert seq.sequence_id and len(seq.tokens) == len(seq.logprobs) <= 4


def test_a_saved_state_continues_like_the_original_and_two_clients_do_not_touch_each_other(service, server):
    first = service.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
    data = data_of(first.get_tokenizer())
    for _ in range(3):
        step(first, data, lr=5e-3)
    path = first.save_state("three").result().path
    assert path.endswith("/weights/three")
    copy = service.create_training_client_from_state_with_optimizer(path).result()
    assert copy.model_id != first.model_id
    original = [step(first, data, lr=5e-3) for _ in range(2)]
    restored = [step(copy, data, lr=5e-3) for _ in range(2)]
    assert abs(original[0] - restored[0]) < 1e-4 and abs(original[1] - restored[1]) < 1e-4, (original, restored)
    without = service.create_training_client_from_state(path).result()  # weights only: fresh moments
    assert abs(step(without, data, lr=5e-3) - original[0]) < 1e-4

    # interleaved steps: neither client's weights move when the other steps
    other = service.create_lora_training_client(base_model=MODEL, rank=4, seed=2).result()
    # a client created beside others wraps the same layers, the output head included (not others' LoRA layers)
    targets = {m.model_id: m.targets for m in server.runtime.tinker.bench.models.values()}
    assert targets[other.model_id] == targets[first.model_id] and "lm_head" in targets[other.model_id]
    mine = first.forward(data, "cross_entropy").result().loss_fn_outputs
    theirs = other.forward(data, "cross_entropy").result().loss_fn_outputs
    for _ in range(3):
        step(other, data, lr=1e-2)
        again = first.forward(data, "cross_entropy").result().loss_fn_outputs
        assert all(
            np.array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy()) for a, b in zip(mine, again, strict=True)
        )
    step(first, data, lr=1e-2)
    moved = other.forward(data, "cross_entropy").result().loss_fn_outputs
    assert not np.array_equal(moved[0]["logprobs"].to_numpy(), theirs[0]["logprobs"].to_numpy())
    rest = tinker.RestClient(base_url=server.url, api_key="tml-client-key-1")
    runs = rest.list_training_runs().result()
    assert first.model_id in {r.training_run_id for r in runs.training_runs}
    listed = rest.list_checkpoints(first.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [path]


def test_bad_input_gets_the_sdks_4xx_within_a_second(service, server):
    client = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    ids = client.get_tokenizer().encode("one two three")
    good = {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}
    short = {**good, "weights": [1.0]}  # targets and weights of different lengths
    cases = [
        ("unknown loss", lambda: client.forward_backward([datum(ids, good)], "no_such_loss").result()),
        ("lengths", lambda: client.forward_backward([datum(ids, short)], "cross_entropy").result()),
        ("unknown model", lambda: service.create_lora_training_client(base_model="nope", rank=4).result()),
        ("no provenance", lambda: client.forward_backward([datum(ids, rl(ids))], "stable_reinforce").result()),
        ("unknown sequence", lambda: client.forward_backward([provenanced(ids)], "stable_reinforce").result()),
    ]
    for name, call in cases:
        start = time.monotonic()
        with pytest.raises((tinker.APIStatusError, ValueError)) as raised:
            call()
        assert time.monotonic() - start < 1.0, name
        status = getattr(raised.value, "status_code", None) or getattr(raised.value.__cause__, "status_code", None)
        assert status is not None and 400 <= status < 500, (name, raised.value)
    headers = {"X-API-Key": "tml-client-key-1"}
    lost = httpx2.post(server.url + "/api/v1/retrieve_future", json={"request_id": "x"}, headers=headers)
    assert lost.status_code == 404 and "no future" in lost.text
    wrong = httpx2.get(server.url + "/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-bad"})
    plain = httpx2.get(server.url + "/api/v1/get_server_capabilities", headers={"X-API-Key": "client-key-1"})
    assert wrong.status_code == plain.status_code == 401 and "tml-" in plain.text


def datum(ids: list[int], inputs: dict) -> types.Datum:  # type: ignore[type-arg]
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)


def rl(ids: list[int]) -> dict:  # type: ignore[type-arg]
    n = len(ids) - 1
    return {"target_tokens": ids[1:], "logprobs": [0.0] * n, "advantages": [1.0] * n}


def provenanced(ids: list[int]) -> types.Datum:
    n = len(ids) - 1
    spans = [types.SampledProvenanceSpan(sequence_id="never-sampled", length=n)]
    inputs = [types.PromptProvenanceSpan(sequence_id="never-sampled", length=n)]
    return datum(ids, rl(ids)).with_provenance(model_input=inputs, loss_fn_inputs=spans)


def test_saved_states_are_mirrored_to_the_bucket_and_load_from_it(model_dir, tmp_path):
    import shutil

    bucket = tmp_path / "bucket"
    live = LiveServer(model_dir, checkpoint_uri=f"file://{bucket}", state_dir=tmp_path / "state")
    try:
        with tinker.ServiceClient(base_url=live.url, api_key="tml-any") as service:
            client = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
            data = data_of(client.get_tokenizer())[:2]
            step(client, data)
            path = client.save_state("mirrored").result().path
            model_id = path.split("/")[2]
            remote = bucket / "tinker" / model_id / "weights" / "mirrored"
            assert {p.name for p in remote.iterdir()} >= {"adapter_model.safetensors", "optimizer.pt", "meta.json"}
            local = live.runtime.tinker.bench.checkpoints.directory(path)
            shutil.rmtree(local)  # as on another machine that holds only the bucket
            copy = service.create_training_client_from_state_with_optimizer(path).result()
            assert (local / "meta.json").exists()
            assert abs(step(copy, data) - step(client, data)) < 1e-4
    finally:
        live.stop()


def test_a_full_model_client_trains_a_copy_of_its_own_within_the_servers_limit(service, server):
    from transformers import AutoModelForCausalLM

    from agentjet_client.finetune.cookbook import create_full_training_client

    lora = service.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    data = data_of(lora.get_tokenizer())
    base = service.create_sampling_client(base_model=MODEL).result()
    probe = types.ModelInput.from_ints(data[0].model_input.to_ints())
    lora_before = lora.forward(data, "cross_entropy").result().loss_fn_outputs
    base_before = base.compute_logprobs(probe).result()

    full = create_full_training_client(service, MODEL)
    info = full.get_info()
    assert info.is_lora is False and info.lora_rank is None
    before = loss_per_token(full, data)
    for _ in range(10):
        step(full, data, lr=1e-3)
    after = loss_per_token(full, data)
    print(f"full-model client: cross-entropy per token {before:.3f} -> {after:.3f} in 10 steps at 1e-3")
    assert after < before / 2, (before, after)  # every weight trains: far faster than LoRA on this set
    # a copy of its own: the LoRA clients' frozen base and the base sampler did not move
    lora_after = lora.forward(data, "cross_entropy").result().loss_fn_outputs
    assert all(
        np.array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())
        for a, b in zip(lora_before, lora_after, strict=True)
    )
    assert base.compute_logprobs(probe).result() == base_before

    # one full client is this server's limit: a second is refused with the reason, within a second
    headers = {"X-API-Key": "tml-client-key-1"}
    start = time.monotonic()
    refused = httpx2.post(
        server.url + "/api/v1/create_model",
        json={"session_id": service.holder.get_session_id(), "model_seq_id": 99, "base_model": MODEL},
        headers=headers,
    )
    assert time.monotonic() - start < 1.0
    assert refused.status_code == 409 and "--tinker-full-clients 1" in refused.text, refused.text

    # its sampler samples the trained copy: its log-probs are the client's forward's
    forward = full.forward(data[:1], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    sampler = full.save_weights_and_get_sampling_client().result()
    ids = [*data[0].model_input.to_ints(), data[0].loss_fn_inputs["target_tokens"].data[-1]]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    assert np.abs(np.array(scored[1:]) - forward).max() < 2e-3

    # a saved state is a Hugging Face model directory, and continues like the original once loaded
    path = full.save_state("full-ten").result().path
    directory = server.runtime.tinker.bench.checkpoints.directory(path)
    reloaded = AutoModelForCausalLM.from_pretrained(str(directory))
    logits = reloaded(input_ids=torch.tensor([data[0].model_input.to_ints()])).logits[0]
    targets = torch.tensor(data[0].loss_fn_inputs["target_tokens"].data)
    recompute = torch.log_softmax(logits.float(), -1).gather(1, targets[:, None])[:, 0].detach().numpy()
    assert np.abs(recompute - forward).max() < 2e-3
    next_loss = step(full, data, lr=1e-3)
    unloaded = httpx2.post(server.url + "/api/v1/unload_model", json={"model_id": full.model_id}, headers=headers)
    assert unloaded.status_code == 200
    while server.runtime.tinker.bench.full.trainable:  # unloaded on the workbench's thread
        time.sleep(0.05)
    copy = service.create_training_client_from_state_with_optimizer(path).result()
    assert copy.get_info().is_lora is False
    assert abs(step(copy, data, lr=1e-3) - next_loss) < 1e-4
    runs = {
        r.training_run_id: r
        for r in tinker.RestClient(base_url=server.url, api_key="tml-client-key-1")
        .list_training_runs()
        .result()
        .training_runs
    }
    assert runs[full.model_id].is_lora is False and runs[lora.model_id].is_lora is True
