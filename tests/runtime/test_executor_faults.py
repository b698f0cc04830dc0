"""A fault anywhere in a device worker fails that job alone: the others finish, nothing hangs."""

from __future__ import annotations

import functools

import pytest
import torch

from sweepmaster.runtime import Device, ShardExecutor, SpilledJob, VirtualDevice, train_plain
from sweepmaster.runtime.execution.jobs import SpilledRun
from sweepmaster.runtime.training.compute import ShardCompute
from sweepmaster.runtime.training.fused_spill import FusedMembers, SpilledFusedJob
from sweepmaster.runtime.training.shard_store import ShardStore
from sweepmaster.runtime.training.spill import ModuleMember
from tests.kit.fused import assert_equals_plain, member
from tests.kit.spill import Recorder, assert_weights, tiny_config, tiny_spec

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET = 500_000  # bytes: the tiny GPT-2 spills into 3 shards here
#: A hang guard, not a timing assertion: every job here ends within seconds.
HANG_GUARD_S = 300


class InjectedFault(RuntimeError):
    """The error a test injects."""


def good_specs():
    return [
        tiny_spec("adamw", name="good", seed=2, max_steps=4),
        tiny_spec("sgd", name="small", seed=3, max_steps=3, batch_size=2,
                  model=tiny_config(n_layer=1, n_embd=16)),
    ]


def expected_weights(name: str) -> dict[str, torch.Tensor]:
    """Plain training's weights, cached per intra-op thread count (it changes float sums)."""
    return _expected_weights(name, torch.get_num_threads())


@functools.cache
def _expected_weights(name: str, threads: int) -> dict[str, torch.Tensor]:
    spec = {s.name: s for s in good_specs()}[name]
    return train_plain(spec, Device("cpu")).state_dict


class FailsAtStep(Recorder):
    """A real callback that raises at its second step."""

    def on_step(self, event):
        super().on_step(event)
        if event.step == 2:
            raise InjectedFault("callback")


def fail_faulty(cls: type, name: str, monkeypatch: pytest.MonkeyPatch, *, after: bool = False,
                oom: bool = False, from_step: int = 0) -> None:
    """Make ``cls.name`` raise for the job named ``faulty`` (before or after the real work).

    From its step ``from_step`` on (a job's first step re-plans it when it runs out of memory).
    """
    original = getattr(cls, name)

    def faulty(self, *args, **kwargs):
        # a part: its job's members' name
        job = self._job if isinstance(self, ShardStore) else \
            self.members if isinstance(self, ShardCompute) else self
        members = job.members if isinstance(job, (SpilledJob, SpilledFusedJob)) else job
        if isinstance(members, ModuleMember):
            job_name = members.spec.name
        elif isinstance(members, FusedMembers):
            job_name = "faulty" if members.runs[0].spec.name == "trial-10" else ""
        else:
            job_name = job.job_id
        if job_name != "faulty" or getattr(job, "step", 0) < from_step:
            return original(self, *args, **kwargs)
        if after:
            original(self, *args, **kwargs)
        if oom:  # a real out-of-memory: the device's meter refuses the allocation
            device = next(a for a in args if isinstance(a, Device))
            with device.meter.metering():
                torch.empty(2 * BUDGET, dtype=torch.uint8, device=device.torch_device)
        raise InjectedFault(name)

    monkeypatch.setattr(cls, name, faulty)


# stage -> how the fault is injected; every stage is reached by the job named "faulty"
STAGES = {
    "prefetch": lambda mp: fail_faulty(SpilledJob, "prefetch", mp),
    "prefetch-beside": lambda mp: fail_faulty(SpilledRun, "prefetch", mp),
    "promote": lambda mp: fail_faulty(ShardStore, "promote", mp),
    "forward": lambda mp: fail_faulty(ShardCompute, "forward_shard", mp, after=True),
    "backward": lambda mp: fail_faulty(ShardCompute, "backward_shard", mp),
    "update": lambda mp: fail_faulty(ModuleMember, "update", mp, after=True),
    "evaluation": lambda mp: fail_faulty(ShardCompute, "eval_shard", mp),
    "result": lambda mp: fail_faulty(SpilledJob, "result", mp),
    "out-of-memory": lambda mp: fail_faulty(ShardCompute, "backward_shard", mp, oom=True,
                                            from_step=1),
    "callback": None,  # a real callback raises
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_fault_at_any_stage_fails_that_job_alone(
    stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    inject = STAGES[stage]
    if inject is not None:
        inject(monkeypatch)
    faulty = tiny_spec("adamw", name="faulty", seed=1, max_steps=3)
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    held_before = device.meter.live_bytes
    # One device and round-robin: the jobs alternate whatever the timing, so the lookahead of
    # the good job's tasks names the faulty job and prefetches it beside them.
    executor = ShardExecutor([device], policy="round-robin", plan_activations=False)
    try:
        good, small = good_specs()
        futures = {
            "good": executor.submit(good, Recorder()),
            "faulty": executor.submit(faulty, FailsAtStep() if inject is None else Recorder()),
            "small": executor.submit(small, Recorder()),
        }
        assert executor.will_spill(faulty) and not executor.will_spill(small)
        expected = torch.OutOfMemoryError if stage == "out-of-memory" else InjectedFault
        with pytest.raises(expected):
            futures["faulty"].result(timeout=HANG_GUARD_S)
        for name in ("good", "small"):
            result = futures[name].result(timeout=HANG_GUARD_S)
            assert_weights(result.state_dict, expected_weights(name), exact=False)
            assert result.peak_device_bytes is not None and result.peak_device_bytes <= BUDGET
        # the device runs a job submitted after the fault
        late = executor.submit(good, Recorder()).result(timeout=HANG_GUARD_S)
        assert_weights(late.state_dict, expected_weights("good"), exact=False)
    finally:
        executor.close(wait=False, cancel=True)
    assert device.meter.live_bytes == held_before


FUSED_STAGES = {
    "prefetch": lambda mp: fail_faulty(SpilledFusedJob, "prefetch", mp),
    "promote": lambda mp: fail_faulty(ShardStore, "promote", mp),
    "backward": lambda mp: fail_faulty(ShardCompute, "backward_shard", mp),
}


@pytest.mark.parametrize("stage", list(FUSED_STAGES))
def test_a_fault_in_a_spilled_fused_array_fails_its_members_alone(
    stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    FUSED_STAGES[stage](monkeypatch)
    budget = 2 * 2**20
    device = VirtualDevice("cpu:0", budget_bytes=budget)
    executor = ShardExecutor([device], spill="always", policy="round-robin")
    try:
        good = member(12)
        good_future = executor.submit(good)
        futures = executor.submit_fused([member(10), member(11)], name="faulty")
        for future in futures:
            with pytest.raises(InjectedFault):
                future.result(timeout=HANG_GUARD_S)
        result = good_future.result(timeout=HANG_GUARD_S)
        assert_equals_plain(result, good, "sgd")
        assert result.peak_device_bytes is not None and result.peak_device_bytes <= budget
    finally:
        executor.close(wait=False, cancel=True)
    assert device.meter.live_bytes == 0
