"""The table of optimizers: every entry's state, plain build and planning bytes agree."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from sweepmaster.runtime.planning.profile import optimizer_state_bytes
from sweepmaster.runtime.training.optimizers import OPTIMIZERS, optimizer_entry
from sweepmaster.runtime.training.plain import build_optimizer
from sweepmaster.workload import OptimizerSpec
from sweepmaster.workload.spec import OptimizerName

SPECS = {"adamw": OptimizerSpec(name="adamw", lr=1e-3, weight_decay=0.1),
         "sgd": OptimizerSpec(name="sgd", lr=0.1, momentum=0.9),
         "lion": OptimizerSpec(name="lion", lr=1e-4, weight_decay=0.1)}


def test_the_table_names_every_optimizer_a_spec_takes() -> None:
    assert list(OPTIMIZERS) == list(get_args(OptimizerName)) == list(SPECS)
    with pytest.raises(ValueError, match="'adamw', 'sgd', 'lion', got 'adam'"):
        optimizer_entry("adam")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_entrys_state_is_its_plain_optimizers_after_a_step(name: str) -> None:
    """What planning counts and a checkpoint maps is what the plain optimizer keeps."""
    entry, spec = OPTIMIZERS[name], SPECS[name]
    param = torch.nn.Parameter(torch.randn(4, 3))
    optimizer = build_optimizer([param], spec)
    assert type(optimizer).__name__ in entry.reference
    param.grad = torch.randn(4, 3)
    optimizer.step()
    state = optimizer.state[param]
    assert sorted(state) == sorted([*entry.state_keys(spec), *(["step"] if entry.step_counter
                                                                else [])])
    assert optimizer_state_bytes(param.nbytes, spec) == sum(
        state[key].nbytes for key in entry.state_keys(spec))
    filled: dict[str, object] = {}
    entry.fill_state(param, filled, spec)
    assert sorted(filled) == sorted(state)


def test_sgd_without_momentum_keeps_no_state() -> None:
    assert OPTIMIZERS["sgd"].state_keys(OptimizerSpec(name="sgd")) == ()


def test_lion_refuses_a_zero_learning_rate() -> None:
    with pytest.raises(ValueError, match="lr must be > 0 for Lion"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimizerSpec(name="lion", lr=0))
