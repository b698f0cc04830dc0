"""Spilled training checkpoints: a spilled job stopped after step k resumes to the same weights.

The crash is a callback raising after a step; the resumed run (spilled, or plain from the
spilled job's checkpoint, or spilled from plain's) ends with ``torch.equal`` weights of an
uninterrupted spilled run and of plain training (CPU, fp32, dropout on, 4 shards, tied wte).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from sweepmaster.runtime import Device, VirtualDevice, train_plain, train_spilled
from sweepmaster.runtime.execution.jobs import SpilledRun
from sweepmaster.runtime.training.training_state import checkpoint_files, job_key, load_latest
from tests.kit.spill import MiB, Recorder, assert_weights, plain_result, tiny_plan, tiny_spec


class Crash(Exception):
    pass


class CrashAfter(Recorder):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.crash_step = step

    def on_step(self, event):
        super().on_step(event)
        if event.step == self.crash_step:
            raise Crash(f"after step {event.step}")


def _steps(state_dir: Path) -> list[int]:
    return [int(p.name[5:14]) for p in checkpoint_files(state_dir)]


def uninterrupted_spilled(opt_name: str):
    """The uninterrupted spilled run, cached per intra-op thread count (see ``plain_result``)."""
    return _uninterrupted_spilled(opt_name, torch.get_num_threads())


@functools.cache
def _uninterrupted_spilled(opt_name: str, threads: int):
    return _spill(tiny_spec(opt_name))


def _spill(spec, callbacks=None):
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    return train_spilled(spec, device, tiny_plan(spec), callbacks)


@pytest.mark.parametrize(("opt_name", "crash_step", "every", "saved"), [
    ("adamw", 5, 2, 4),   # crash after the last step: resume from step 4
    pytest.param("sgd", 3, 2, 2, marks=pytest.mark.slow),  # resume from step 2
    # deferred clipped updates: update tasks apply them before each checkpoint
    pytest.param("adamw-clip", 3, 1, 2, marks=pytest.mark.slow),
])
def test_spilled_resume_equals_uninterrupted(opt_name: str, crash_step: int, every: int,
                                             saved: int, tmp_path: Path) -> None:
    spec = tiny_spec(opt_name, state_dir=tmp_path / "state", checkpoint_every=every)
    first = CrashAfter(crash_step)
    with pytest.raises(Crash):
        _spill(spec, first)
    assert _steps(spec.state_dir)[0] == saved
    torch.manual_seed(1234)  # the process's generator moved on meanwhile
    second = Recorder()
    resumed = _spill(spec, second)
    uninterrupted = uninterrupted_spilled(opt_name)
    assert_weights(resumed.state_dict, uninterrupted.state_dict)
    assert_weights(resumed.state_dict, plain_result(opt_name).state_dict)
    assert second.starts[0].resumed_from_step == saved
    assert [e.step for e in second.steps] == list(range(saved + 1, 6))
    for name in ("train_loss", "lr", "eval_loss"):
        assert resumed.history(name) == uninterrupted.history(name), name


def test_deferred_clipped_updates_never_hold_a_checkpoint_back(tmp_path: Path) -> None:
    """A clipping job writes at every multiple, the steps and weights of plain's checkpoints.

    No evaluation at steps 2 and 4: ``update`` tasks apply the deferred clipped updates, then
    the checkpoint is written (at step 3 an evaluation applies them).
    """
    spec = tiny_spec("adamw-clip", eval_every=3, state_dir=tmp_path / "spilled",
                     checkpoint_every=2, keep_checkpoints=5)
    _spill(spec)
    plain = dataclasses.replace(spec, state_dir=tmp_path / "plain")
    train_plain(plain, Device("cpu"))
    assert _steps(spec.state_dir) == _steps(plain.state_dir) == [4, 2]
    key = job_key(spec)
    spilled_state = load_latest(spec.state_dir, key, "cpu")
    plain_state = load_latest(plain.state_dir, key, "cpu")
    assert spilled_state is not None and plain_state is not None
    assert spilled_state.step == plain_state.step == 4
    assert_weights(spilled_state.model, plain_state.model)
    assert [(m.step, m.name) for m in spilled_state.metrics] == [
        (m.step, m.name) for m in plain_state.metrics]


@pytest.mark.parametrize("first_path", ["spilled", "plain"])
def test_a_trial_resumes_in_the_other_path(first_path: str, tmp_path: Path) -> None:
    spec = tiny_spec("adamw", state_dir=tmp_path / "state", checkpoint_every=2)
    with pytest.raises(Crash):
        if first_path == "spilled":
            _spill(spec, CrashAfter(3))
        else:
            train_plain(spec, Device("cpu"), CrashAfter(3))
    assert _steps(spec.state_dir)[0] == 2
    second = Recorder()
    if first_path == "spilled":
        resumed = train_plain(spec, Device("cpu"), second)
    else:
        resumed = _spill(spec, second)
    assert second.starts[0].resumed_from_step == 2
    assert_weights(resumed.state_dict, plain_result("adamw").state_dict)


def test_a_resumed_spilled_run_has_a_shorter_chain(tmp_path: Path) -> None:
    spec = tiny_spec("adamw", state_dir=tmp_path / "state", checkpoint_every=2)
    with pytest.raises(Crash):
        _spill(spec, CrashAfter(3))
    plan = tiny_plan(spec)
    fresh = SpilledRun("fresh", dataclasses.replace(spec, state_dir=None, checkpoint_every=None),
                       plan, None, None)
    resumed = SpilledRun("resumed", spec, plan, None, None)
    per_step = fresh.num_tasks // spec.total_steps
    assert resumed.num_tasks == per_step * (spec.total_steps - 2)
