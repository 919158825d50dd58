"""Weight fan-out to engine replicas (``engine/fanout.py``): two shared-memory sets written in turn and
reused, in the engines' dtype for floating-point tensors only."""

import torch

from agentjet_server.engine.fanout import SharedWeights


def _weights(scale: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 3), scale), "steps": torch.tensor([7], dtype=torch.int64)}


def test_updates_take_the_two_sets_in_turn_and_reuse_their_memory():
    fanout = SharedWeights("float32")
    first, second, third = (fanout.share(_weights(s)) for s in (1.0, 2.0, 3.0))
    assert all(t.is_shared() for t in [*first.values(), *second.values()])
    assert third["w"].data_ptr() == first["w"].data_ptr()  # the third update rewrote the first set
    assert second["w"].data_ptr() != first["w"].data_ptr()
    assert torch.equal(second["w"], torch.full((4, 3), 2.0))  # the newest weights stay whole meanwhile
    assert torch.equal(third["w"], torch.full((4, 3), 3.0))


def test_floating_point_tensors_travel_in_the_engines_dtype_and_the_rest_as_they_are():
    shared = SharedWeights("bfloat16").share(_weights(1.5))
    assert shared["w"].dtype == torch.bfloat16 and torch.equal(shared["w"].float(), torch.full((4, 3), 1.5))
    assert shared["steps"].dtype == torch.int64
    kept = SharedWeights("auto").share(_weights(1.5))  # the engines pick their own: the learner's dtype goes
    assert kept["w"].dtype == torch.float32


def test_a_tensor_that_changes_shape_gets_new_memory():
    fanout = SharedWeights(None)
    fanout.share(_weights(1.0))
    fanout.share(_weights(1.0))
    grown = fanout.share({"w": torch.ones(8, 3)})
    assert grown["w"].shape == (8, 3) and grown["w"].is_shared()
