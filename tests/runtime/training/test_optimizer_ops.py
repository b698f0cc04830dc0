"""A fused optimizer step runs as many operators for 48 parameter tensors as for 12.

Counted with ``torch.profiler`` on the CPU: every top-level ``aten::`` operator one step of a
shard update runs (an operator a multi-tensor kernel runs inside itself is part of it), after a
first step that made the state.

    python tests/runtime/training/test_optimizer_ops.py   # counts per optimizer and tensor count
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from sweepmaster.runtime.training.fused_optim import build_fused_optimizer
from sweepmaster.runtime.training.optimizers import OPTIMIZERS
from sweepmaster.workload import OptimizerSpec

CPU = torch.device("cpu")
SHAPES = [(8, 4), (4,), (2, 3, 4)]
#: Per optimizer, K = 3 members with their own hyperparameters (SGD: mixed Nesterov).
SPECS = {
    "adamw": [OptimizerSpec(lr=1e-3 * (1 + k), betas=(0.9, 0.99 + 0.001 * k),
                            weight_decay=0.01 * k) for k in range(3)],
    "sgd": [OptimizerSpec(name="sgd", lr=0.1, momentum=0.9 * (k > 0), nesterov=k == 2,
                          weight_decay=0.01) for k in range(3)],
    "lion": [OptimizerSpec(name="lion", lr=1e-4 * (1 + k), weight_decay=0.1) for k in range(3)],
}


def count_step_ops(specs: list[OptimizerSpec], num_tensors: int) -> int:
    """Top-level ``aten::`` operators of one fused step over ``num_tensors`` stacked tensors."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn((len(specs), *SHAPES[i % len(SHAPES)]), generator=generator)
              .requires_grad_() for i in range(num_tensors)]
    optimizer = build_fused_optimizer(specs, CPU)
    lrs = [spec.lr for spec in specs]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step(params, lrs)  # makes the state
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        optimizer.step(params, lrs)
    return sum(1 for event in prof.events()
               if event.name.startswith("aten::") and event.cpu_parent is None)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_fused_steps_operators_do_not_grow_with_the_parameter_tensors(name: str) -> None:
    few, many = count_step_ops(SPECS[name], 12), count_step_ops(SPECS[name], 48)
    assert few == many
    assert few <= 100


def test_every_optimizer_of_the_table_is_counted() -> None:
    assert set(SPECS) == set(OPTIMIZERS)


if __name__ == "__main__":
    for name, specs in SPECS.items():
        print(name, {n: count_step_ops(specs, n) for n in (12, 48)})
