"""The Tinker API's losses against their formulas (docs/tinker.md), values and gradients, on small tensors;
and the request checks that refuse what a loss would ignore."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentjet_server.errors import InvalidRequestError
from agentjet_server.tinker import losses
from agentjet_server.tinker.checks import check_datum
from agentjet_server.tinker.wire import Datum

Q = torch.tensor([-1.0, -2.0, -0.5, -3.0])
A = torch.tensor([1.0, -1.0, 2.0, 0.0])


def run(name: str, logp0: list[float], config: dict | None = None, **extra: torch.Tensor):  # type: ignore[no-untyped-def,type-arg]
    logp = torch.tensor(logp0, requires_grad=True)
    x = {"logprobs": Q, "advantages": A, "weights": torch.tensor([1.0, 0.5, -1.0, 0.0]), **extra}
    loss = losses.LOSSES[name](logp, x, config or {})
    loss.backward()
    return float(loss.detach()), logp.grad


def test_each_loss_is_its_formula_in_value_and_gradient():
    lp = [-0.8, -2.5, -0.4, -3.0]
    t = torch.tensor(lp)
    r = torch.exp(t - Q)
    value, grad = run("cross_entropy", lp)
    assert value == pytest.approx(-(1 * -0.8 + 0.5 * -2.5 - 1 * -0.4)) and grad.tolist() == [-1.0, -0.5, 1.0, -0.0]
    value, grad = run("importance_sampling", lp)
    assert value == pytest.approx(float(-(r * A).sum())) and torch.allclose(grad, -r * A)
    value, grad = run("ppo", lp)
    clipped = torch.minimum(r * A, r.clamp(0.8, 1.2) * A)
    assert value == pytest.approx(float(-clipped.sum()))
    # a token whose ratio left the band on the side its advantage pushes toward gets no gradient
    assert grad[0] == 0 and r[0] > 1.2 and grad[1] == 0 and r[1] < 0.8 and grad[2] != 0
    value, grad = run("cispo", lp)
    assert torch.allclose(grad, -r.clamp(0.8, 1.2) * A)  # the clipped weight is a constant
    value, grad = run("dro", lp, {"beta": 0.2})
    assert value == pytest.approx(float(-(t * A - 0.1 * (t - Q) ** 2).sum()))
    assert torch.allclose(grad, -(A - 0.2 * (t - Q)))
    value, grad = run("gspo", lp, {"clip_low_threshold": 0.0, "clip_high_threshold": 100.0})
    mask = (A != 0).float()
    s = torch.exp(((t - Q) * mask).sum() / mask.sum())
    assert value == pytest.approx(float(-(s * A * mask).sum()), rel=1e-5)
    value, grad = run("stable_reinforce", lp, {"is_cap": 1.1, "mask_bound": 1.3})
    keep = ((r >= 1 / 1.3) & (r <= 1.3)).float()
    assert torch.allclose(grad, -keep * r.clamp(max=1.1) * A)


def test_per_token_thresholds_replace_the_configured_ones():
    lp = [-0.8, -2.5, -0.4, -3.0]
    wide = {"clip_low_threshold": torch.full((4,), 0.0), "clip_high_threshold": torch.full((4,), 10.0)}
    value, _ = run("ppo", lp, **wide)
    assert value == pytest.approx(run("importance_sampling", lp)[0])  # nothing clipped
    assert run("ppo", lp)[0] != value


def test_a_loss_refuses_an_input_it_would_ignore_and_a_config_key_it_does_not_know():
    tokens = [1, 2, 3]
    inputs = {"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, dtype=np.float32)}
    check_datum(Datum(tokens, inputs), 0, "cross_entropy", vocab=10, max_context=100)
    with pytest.raises(InvalidRequestError, match="not an input of cross_entropy"):
        check_datum(Datum(tokens, {**inputs, "mask": np.ones(3, dtype=np.float32)}), 0, "cross_entropy", 10, 100)
    with pytest.raises(InvalidRequestError, match="does not apply to ppo"):
        losses.check("ppo", {"beta": 0.1})
    with pytest.raises(InvalidRequestError, match="unknown loss_fn"):
        losses.check("nope", {})
