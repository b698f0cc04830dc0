"""Fused optimizers: each member's update equals torch.optim on that member alone (HFTA)."""

from __future__ import annotations

import pytest
import torch
from lion_pytorch import Lion

from sweepmaster.runtime.devices.device import VirtualDevice
from sweepmaster.runtime.training.fused_optim import (
    FusedAdamW,
    FusedLion,
    FusedSGD,
    build_fused_optimizer,
)
from sweepmaster.workload import OptimizerSpec

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


SHAPES = [(7, 5), (5,), (3, 2, 4)]

SGD_SPECS = [
    OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    OptimizerSpec(name="sgd", lr=0.05, momentum=0.0, weight_decay=0.0),
    OptimizerSpec(name="sgd", lr=0.2, momentum=0.5, weight_decay=0.1),
]
ADAMW_SPECS = [
    OptimizerSpec(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    OptimizerSpec(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
    OptimizerSpec(lr=1e-2, betas=(0.5, 0.9), eps=1e-7, weight_decay=0.01),
]
LION_SPECS = [
    OptimizerSpec(name="lion", lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0),
    OptimizerSpec(name="lion", lr=3e-4, betas=(0.95, 0.98), weight_decay=0.1),
    OptimizerSpec(name="lion", lr=1e-3, betas=(0.5, 0.9), weight_decay=1.0),
]


def stacked_params(num_members: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn((num_members, *shape), generator=generator).requires_grad_()
        for shape in SHAPES
    ]


def grads_for_step(num_members: int, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn((num_members, *shape), generator=generator) for shape in SHAPES]


def lrs_for_step(specs: list[OptimizerSpec], step: int) -> list[float]:
    return [spec.lr * (step + 1) / 4 for spec in specs]  # a warmup-like schedule per member


def reference_run(
    specs: list[OptimizerSpec], params0: list[torch.Tensor], num_steps: int
) -> list[list[torch.Tensor]]:
    """torch.optim on each member alone; returns per member its final tensors."""
    finals = []
    for k, spec in enumerate(specs):
        params = [torch.nn.Parameter(p[k].detach().clone()) for p in params0]
        if spec.name == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(
                params,
                lr=spec.lr,
                momentum=spec.momentum,
                weight_decay=spec.weight_decay,
                nesterov=spec.nesterov,
            )
        elif spec.name == "lion":
            optimizer = Lion(params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)
        else:
            optimizer = torch.optim.AdamW(
                params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
            )
        for step in range(num_steps):
            for group in optimizer.param_groups:
                group["lr"] = lrs_for_step(specs, step)[k]
            for p, g in zip(params, grads_for_step(len(specs), step), strict=True):
                p.grad = g[k].clone()
            optimizer.step()
        finals.append([p.detach() for p in params])
    return finals


def fused_run(
    specs: list[OptimizerSpec], params: list[torch.Tensor], num_steps: int
) -> list[torch.Tensor]:
    optimizer = build_fused_optimizer(specs, CPU)
    for step in range(num_steps):
        for p, g in zip(params, grads_for_step(len(specs), step), strict=True):
            p.grad = g.clone()
        optimizer.step(params, lrs_for_step(specs, step))
    return params


def test_fused_sgd_equals_torch_sgd_per_member() -> None:
    params = stacked_params(len(SGD_SPECS))
    expected = reference_run(SGD_SPECS, params, num_steps=6)
    actual = fused_run(SGD_SPECS, params, num_steps=6)
    for k in range(len(SGD_SPECS)):
        for p, ref in zip(actual, expected[k], strict=True):
            torch.testing.assert_close(p[k].detach(), ref, rtol=1e-6, atol=1e-6)


def test_fused_adamw_equals_torch_adamw_per_member() -> None:
    params = stacked_params(len(ADAMW_SPECS))
    expected = reference_run(ADAMW_SPECS, params, num_steps=6)
    actual = fused_run(ADAMW_SPECS, params, num_steps=6)
    for k, spec in enumerate(ADAMW_SPECS):
        for p, ref in zip(actual, expected[k], strict=True):
            # Adam divides by sqrt(v): a rounding difference moves a weight by at most ~lr
            # per step; the observed difference is far smaller.
            torch.testing.assert_close(p[k].detach(), ref, rtol=0, atol=1e-4 * spec.lr)


def test_fused_lion_equals_lion_pytorch_per_member() -> None:
    params = stacked_params(len(LION_SPECS))
    expected = reference_run(LION_SPECS, params, num_steps=6)
    actual = fused_run(LION_SPECS, params, num_steps=6)
    for k in range(len(LION_SPECS)):
        for p, ref in zip(actual, expected[k], strict=True):
            torch.testing.assert_close(p[k].detach(), ref, rtol=1e-6, atol=1e-6)


def test_fused_lion_keeps_lion_pytorchs_state_for_a_checkpoint() -> None:
    params = stacked_params(len(LION_SPECS))
    expected = [torch.nn.Parameter(p[1].detach().clone()) for p in params]
    optimizer = FusedLion(LION_SPECS, CPU)
    reference = Lion(expected, lr=LION_SPECS[1].lr, betas=LION_SPECS[1].betas,
                     weight_decay=LION_SPECS[1].weight_decay)
    for step in range(2):
        for p, q, g in zip(params, expected, grads_for_step(3, step), strict=True):
            p.grad, q.grad = g.clone(), g[1].clone()
        optimizer.step(params, [spec.lr for spec in LION_SPECS])
        reference.step()
    names = [f"p{i}" for i in range(len(params))]
    state = optimizer.member_state(1, names)
    assert list(state) == names
    for name, q in zip(names, expected, strict=True):
        assert list(state[name]) == list(reference.state[q]) == ["exp_avg"]
        torch.testing.assert_close(state[name]["exp_avg"], reference.state[q]["exp_avg"],
                                   rtol=1e-6, atol=1e-7)


def test_remove_member_leaves_the_others_exact() -> None:
    params = stacked_params(3)
    optimizer = FusedAdamW(ADAMW_SPECS, CPU)
    for step in range(3):
        for p, g in zip(params, grads_for_step(3, step), strict=True):
            p.grad = g.clone()
        optimizer.step(params, lrs_for_step(ADAMW_SPECS, step))
    optimizer.remove_member(1)
    assert optimizer.num_members == 2 and optimizer.specs == [ADAMW_SPECS[0], ADAMW_SPECS[2]]
    kept = [p.detach()[[0, 2]].clone().requires_grad_() for p in params]

    pair = [ADAMW_SPECS[0], ADAMW_SPECS[2]]
    twin = [p.detach()[[0, 2]].clone().requires_grad_() for p in stacked_params(3)]
    twin_optimizer = FusedAdamW(pair, CPU)
    for step in range(6):
        grads = [g[[0, 2]] for g in grads_for_step(3, step)]
        if step >= 3:
            for p, g in zip(kept, grads, strict=True):
                p.grad = g.clone()
            optimizer.step(kept, lrs_for_step(pair, step))
        for p, g in zip(twin, grads, strict=True):
            p.grad = g.clone()
        twin_optimizer.step(twin, lrs_for_step(pair, step))
    for p, q in zip(kept, twin, strict=True):
        assert torch.equal(p, q)


def test_invalid_members_are_refused() -> None:
    with pytest.raises(ValueError, match="sgd"):
        FusedSGD([SGD_SPECS[0], ADAMW_SPECS[0]], CPU)
    with pytest.raises(ValueError, match="Nesterov"):
        FusedSGD([OptimizerSpec(name="sgd", momentum=0.0, nesterov=True)], CPU)
    with pytest.raises(ValueError, match="at least one"):
        build_fused_optimizer([], CPU)
    with pytest.raises(IndexError):
        FusedSGD(SGD_SPECS, CPU).remove_member(3)
    with pytest.raises(ValueError, match="Lion"):
        FusedLion([OptimizerSpec(name="lion", lr=0.0)], CPU)



@pytest.mark.parametrize("specs", [SGD_SPECS, ADAMW_SPECS, LION_SPECS],
                         ids=["sgd", "adamw", "lion"])
def test_a_fused_step_holds_at_most_two_parameter_sized_temporaries(specs) -> None:
    """The plan's update peak (state + 2 x the largest parameter) bounds the metered step."""
    meter = VirtualDevice("cpu:0", budget_bytes=2**30).meter
    assert meter is not None
    p = torch.randn(len(specs), 64, 64, requires_grad=True)
    optimizer = build_fused_optimizer(specs, CPU)
    for step in range(3):  # the first step makes the state (momentum; m, v) as it goes
        p.grad = torch.randn_like(p)
        before = meter.live_bytes
        meter.reset_peak()
        with meter.metering():
            optimizer.step([p], lrs_for_step(specs, step))
        state = (1 if specs is SGD_SPECS else 2) * p.nbytes if step == 0 else 0
        assert meter.peak_bytes - before <= state + 2 * p.nbytes + 1024
