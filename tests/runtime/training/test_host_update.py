"""ZeRO-Offload's update on the host: the same weights, fewer bytes, no optimizer state moved."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from sweepmaster.runtime import Device, SpilledJob, VirtualDevice, train_plain, train_spilled
from sweepmaster.runtime.planning.update_site import with_update_on
from sweepmaster.runtime.training.pipelined import PipelinedRun
from sweepmaster.runtime.training.training_state import job_key, load_latest
from tests.kit.spill import MiB, Recorder, assert_weights, plain_result, tiny_plan, tiny_spec
from tests.runtime.training.test_spill_resume import Crash, CrashAfter

pytestmark = pytest.mark.usefixtures("one_thread")


def host_plan(spec, microbatch_size=None):
    return with_update_on(tiny_plan(spec, microbatch_size), spec.optimizer, "host")


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
@pytest.mark.parametrize("keep", [False, True], ids=["demote", "keep"])
def test_host_update_ends_with_the_device_updates_weights(opt_name: str, keep: bool) -> None:
    """Kept or not between tasks (a host-updated shard leaves the device), bit for bit."""
    spec = tiny_spec(opt_name)
    results = []
    for plan in (tiny_plan(spec), host_plan(spec)):
        job = SpilledJob(spec, plan)
        device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
        while (task := job.next_task()) is not None:
            job.prefetch(job.peek_task(), device)
            job.run(task, device, keep=keep)
        results.append(job.result())
        assert device.meter.live_bytes == 0
        host_steps = job.store.host_updates.num_steps
        assert host_steps == (5 * 4 if plan.update_on == "host" else 0)  # 4 shards update
    device_result, host_result = results
    assert_weights(host_result.state_dict, device_result.state_dict)
    assert_weights(host_result.state_dict, plain_result(opt_name).state_dict)
    assert host_result.history("eval_loss") == device_result.history("eval_loss")


def test_host_update_moves_no_optimizer_state() -> None:
    """Per steady step the host update moves the gradients where the device update writes the
    parameters back, and none of the state the device update promotes and demotes."""
    spec = tiny_spec("adamw", eval_data=None, max_steps=3)
    measured = {}
    for site, plan in (("device", tiny_plan(spec)), ("host", host_plan(spec))):
        assert plan.update_on == site
        job = SpilledJob(spec, plan)
        device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
        while (task := job.next_task()) is not None:
            job.run(task, device)
        steps = job.bookkeeping.step_swap_bytes
        assert steps[1:] == [plan.swap_bytes_per_step] * 2  # the plan's account
        assert job.boundaries.swap_bytes == sum(steps)
        measured[site] = steps
    state_bytes = sum(shard.optimizer_bytes for shard in tiny_plan(spec).shards)
    assert state_bytes > 0
    # steady steps: the device update promotes and demotes every shard's state
    assert [d - h for d, h in zip(measured["device"][1:], measured["host"][1:],
                                  strict=True)] == [2 * state_bytes] * 2
    # the first step has no state to promote: it only demotes it
    assert measured["device"][0] - measured["host"][0] == state_bytes
    plan = host_plan(spec)
    for (kind, _), task in zip(plan.task_order() * 3, plan.task_bytes(3), strict=True):
        assert task.state_bytes == 0 and task.write_back_bytes == 0
        assert (task.kept_bytes == 0) == (kind == "backward")  # updated: the shard leaves


def test_a_job_that_fits_or_clips_updates_on_the_device() -> None:
    spec = tiny_spec("adamw")
    whole = tiny_plan(spec, cuts=[0, 5])
    assert with_update_on(whole, spec.optimizer, "host").update_on == "device"
    clipped = tiny_spec("adamw-clip")  # its updates wait for the global norm
    assert with_update_on(tiny_plan(clipped), clipped.optimizer, "host").update_on == "device"
    forced = with_update_on(host_plan(spec), spec.optimizer, "device")
    assert forced == dataclasses.replace(tiny_plan(spec), update_on="device")


def test_a_pipeline_refuses_a_plan_that_updates_on_the_host() -> None:
    spec = tiny_spec("adamw")
    devices = [VirtualDevice(f"cpu:{i}", budget_bytes=4 * MiB) for i in range(2)]
    with pytest.raises(ValueError, match="updates on the device"):
        PipelinedRun(SpilledJob(spec, host_plan(spec)), devices, [0, 2, 4])


def test_a_host_updated_job_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    """A checkpoint waits for the host steps: its weights and optimizer state are plain's."""
    spec = tiny_spec("adamw", state_dir=tmp_path / "state", checkpoint_every=2)
    with pytest.raises(Crash):
        train_spilled(spec, VirtualDevice("cpu:0", budget_bytes=4 * MiB), host_plan(spec),
                      CrashAfter(3))
    torch.manual_seed(1234)  # the process's generator moved on meanwhile
    resumed = train_spilled(spec, VirtualDevice("cpu:0", budget_bytes=4 * MiB), host_plan(spec),
                            Recorder())
    assert resumed.steps == 5
    assert_weights(resumed.state_dict, plain_result("adamw").state_dict)
    plain = dataclasses.replace(spec, state_dir=tmp_path / "plain")
    train_plain(plain, Device("cpu"))
    spilled_state = load_latest(spec.state_dir, job_key(spec), "cpu")
    plain_state = load_latest(plain.state_dir, job_key(spec), "cpu")
    assert spilled_state is not None and plain_state is not None
    assert spilled_state.step == plain_state.step == 4
    assert_weights(spilled_state.model, plain_state.model)
    assert spilled_state.optimizer.keys() == plain_state.optimizer.keys()
    for name, entry in plain_state.optimizer.items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(spilled_state.optimizer[name][key]),
                               torch.as_tensor(value)), (name, key)
