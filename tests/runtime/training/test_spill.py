from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch import nn
from transformers import GPT2Config

from sweepmaster.runtime import (
    Device,
    ShardExecutor,
    SpilledJob,
    VirtualDevice,
    make_plan,
    plan_job,
    profile_model,
    train_plain,
    train_spilled,
)
from sweepmaster.workload import OptimizerSpec, TrainSpec
from tests.kit.spill import (
    OPTIMIZERS,
    VOCAB,
    MiB,
    Recorder,
    assert_weights,
    plain_result,
    tiny_plan,
    tiny_spec,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("opt_name", ["adamw-clip", "sgd"])
def test_spilled_training_equals_plain_training(opt_name: str) -> None:
    spec = tiny_spec(opt_name)
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    plan = tiny_plan(spec)
    recorder = Recorder()
    result = train_spilled(spec, device, plan, recorder)
    expected = plain_result(opt_name)
    assert_weights(result.state_dict, expected.state_dict)  # dropout on, tied wte, 4 shards
    for name in ("train_loss", "lr", "eval_loss", "eval_perplexity"):
        assert result.history(name) == expected.history(name), name
    assert [p.name for p in result.metrics] == [p.name for p in expected.metrics]
    assert result.objective == expected.objective and result.steps == 5 and not result.pruned
    assert [e.step for e in recorder.steps] == [1, 2, 3, 4, 5]
    assert [e.epoch for e in recorder.steps] == [0, 0, 1, 1, 2]
    assert [e.step for e in recorder.evals] == [0, 2, 4, 5]
    assert recorder.starts[0].num_parameters == sum(
        t.numel() for n, t in expected.state_dict.items() if n != "lm_head.weight"
    )
    assert result.device == "cpu:0" and result.swap_bytes > 0
    assert result.num_promotes == result.num_demotes > 5 * plan.num_tasks_per_step
    assert result.peak_device_bytes is not None and result.peak_device_bytes <= 4 * MiB
    assert device.meter.live_bytes == 0


@pytest.mark.parametrize(("opt_name", "microbatch_size"), [("adamw-clip", 2), ("sgd", 3)])
def test_gradient_accumulation_over_microbatches(opt_name: str, microbatch_size: int) -> None:
    spec = tiny_spec(opt_name)
    plan = tiny_plan(spec, microbatch_size)
    assert [s.microbatch_size for s in plan.shards] == [microbatch_size] * 4
    assert plan.num_microbatches(0) == -(-4 // microbatch_size)
    result = train_spilled(spec, VirtualDevice("cpu:0", budget_bytes=4 * MiB), plan)
    expected = plain_result(opt_name)
    # dropout masks are the full batch's: only the order of float sums differs
    assert_weights(result.state_dict, expected.state_dict, exact=False)
    for name in ("train_loss", "eval_loss"):
        assert [v for _, v in result.history(name)] == pytest.approx(
            [v for _, v in expected.history(name)], abs=1e-5
        )


def test_one_shard_and_deferred_updates_without_eval() -> None:
    spec = tiny_spec("adamw-clip", eval_data=None, max_steps=3)
    expected = train_plain(spec, Device("cpu"))
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    job = SpilledJob(spec, tiny_plan(spec))
    kinds = []
    while (task := job.next_task()) is not None:
        kinds.append((task.kind, task.phase, task.shard))
        job.run(task, device)
    assert kinds[-3:] == [("backward", "update", 1), ("backward", "update", 2),
                          ("backward", "update", 3)]
    assert_weights(job.result().state_dict, expected.state_dict)
    single = train_spilled(spec, device, tiny_plan(spec, cuts=[0, 5]))
    assert_weights(single.state_dict, expected.state_dict)


# ---------------------------------------------------------------- task API


def test_task_sequence_and_order_is_enforced() -> None:
    spec = tiny_spec(max_steps=2, eval_every=None)
    job = SpilledJob(spec, tiny_plan(spec))
    seq = []
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    first = job.next_task()
    assert first is not None and job.peek_task(0) == first
    second = job.peek_task()
    with pytest.raises(ValueError, match="not the next task"):
        job.run(second, device)
    while (task := job.next_task()) is not None:
        seq.append((task.kind, task.shard, task.phase))
        assert task.job_id == spec.name and task.est_seconds >= 0 and task.promote_bytes > 0
        job.run(task, device)
    step = [("forward", 0), ("forward", 1), ("forward", 2), ("backward", 3), ("backward", 2),
            ("backward", 1), ("backward", 0)]
    evaluation = [("forward", i) for i in range(4)]
    assert [(k, s) for k, s, _ in seq] == evaluation + step + step + evaluation
    assert job.next_task() is None and job.result().steps == 2


def test_remaining_seconds_are_the_steps_left_at_the_planned_step_seconds() -> None:
    spec = tiny_spec(max_steps=3, eval_every=None)
    plan = tiny_plan(spec)
    job = SpilledJob(spec, plan)
    assert plan.step_s > 0 and job.remaining_seconds == pytest.approx(3 * plan.step_s)
    job.run_step(VirtualDevice("cpu:0", budget_bytes=4 * MiB))
    assert job.remaining_seconds == pytest.approx(2 * plan.step_s)


def test_tasks_move_between_devices_and_interleave_with_other_jobs() -> None:
    devices = [VirtualDevice(f"cpu:{i}", budget_bytes=4 * MiB) for i in range(2)]
    specs = [tiny_spec("adamw-clip"), tiny_spec("sgd")]
    jobs = [SpilledJob(spec, tiny_plan(spec)) for spec in specs]
    turn = 0
    while any(job.next_task() is not None for job in jobs):
        for index, job in enumerate(jobs):  # alternate jobs, and each job's device per task
            task = job.next_task()
            if task is not None:
                device = devices[(turn + index) % 2]
                job.prefetch(job.peek_task(), device)
                job.run(task, device)
        turn += 1
    assert_weights(jobs[0].result().state_dict, plain_result("adamw-clip").state_dict)
    assert_weights(jobs[1].result().state_dict, plain_result("sgd").state_dict)
    assert all(d.meter.live_bytes == 0 for d in devices)
    assert all(d.transfers.promote_bytes > 0 for d in devices)


def test_swap_volume_per_step_matches_the_plan() -> None:
    spec = tiny_spec("adamw", eval_data=None, max_steps=3)
    for microbatch_size in (None, 2):
        plan = tiny_plan(spec, microbatch_size)
        job = SpilledJob(spec, plan)
        device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
        while (task := job.next_task()) is not None:
            job.run(task, device)
        # step 1 has no optimizer state to promote yet; later steps are the steady state
        assert job.bookkeeping.step_swap_bytes[1:] == [plan.swap_bytes_per_step] * 2
        assert job.bookkeeping.step_swap_bytes[0] < plan.swap_bytes_per_step
        assert job.store.num_promotes == 3 * plan.num_tasks_per_step
        assert job.boundaries.swap_bytes == sum(job.bookkeeping.step_swap_bytes)


def test_pruning_stops_the_job() -> None:
    spec = tiny_spec()
    recorder = Recorder(prune_at=2)
    result = train_spilled(spec, VirtualDevice("cpu:0", budget_bytes=4 * MiB), tiny_plan(spec),
                           recorder)
    assert result.pruned and result.steps == 2 and [e.step for e in recorder.evals] == [0, 2]


class Broken(Recorder):
    """Raises from the callback named ``where`` (at its first call)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def on_start(self, event):
        super().on_start(event)
        if self.where == "start":
            raise RuntimeError("on_start broke")

    def on_step(self, event):
        super().on_step(event)
        if self.where == "step":
            raise RuntimeError("on_step broke")

    def on_eval(self, event):
        super().on_eval(event)
        if self.where == "eval":
            raise RuntimeError("on_eval broke")


@pytest.mark.parametrize(("where", "num_steps", "num_evals"),
                         [("start", 0, 0), ("eval", 0, 1), ("step", 1, 1)])
def test_a_callback_raising_fails_the_job(where: str, num_steps: int, num_evals: int) -> None:
    spec = tiny_spec()
    recorder = Broken(where)
    with pytest.raises(RuntimeError, match=f"on_{where} broke"):
        train_spilled(spec, VirtualDevice("cpu:0", budget_bytes=4 * MiB), tiny_plan(spec),
                      recorder)
    assert len(recorder.starts) == 1
    assert (len(recorder.steps), len(recorder.evals)) == (num_steps, num_evals)


def test_a_non_finite_loss_fails_the_job() -> None:
    spec = tiny_spec("sgd", eval_data=None,
                     optimizer=dataclasses.replace(OPTIMIZERS["sgd"], lr=1e30))
    recorder = Recorder()
    with pytest.raises(FloatingPointError, match="non-finite train loss .* at step"):
        train_spilled(spec, VirtualDevice("cpu:0", budget_bytes=4 * MiB), tiny_plan(spec),
                      recorder)
    assert 0 < len(recorder.steps) < spec.total_steps  # the failing step is not reported


def test_a_checkpoint_that_cannot_be_written_fails_the_job(tmp_path) -> None:
    (tmp_path / "file").write_text("not a directory")
    spec = tiny_spec(state_dir=tmp_path / "file" / "state", checkpoint_every=2)
    recorder = Recorder()
    with pytest.raises(OSError):
        train_spilled(spec, VirtualDevice("cpu:0", budget_bytes=4 * MiB), tiny_plan(spec),
                      recorder)
    assert [e.step for e in recorder.steps] == [1, 2]


def test_plan_for_a_larger_device_runs_out_of_memory(tmp_path) -> None:
    spec = tiny_spec(checkpoint_dir=tmp_path / "ckpt")
    small = VirtualDevice("cpu:0", budget_bytes=200_000)
    with pytest.raises(torch.OutOfMemoryError, match="cpu:0 out of memory"):
        train_spilled(spec, small, tiny_plan(spec))
    gc.collect()  # the traceback's frames hold the failed task's tensors
    assert small.meter.live_bytes == 0
    result = train_spilled(spec, VirtualDevice("cpu:1", budget_bytes=4 * MiB), tiny_plan(spec))
    assert result.checkpoint_path == tmp_path / "ckpt" and (tmp_path / "ckpt").is_dir()


# ---------------------------------------------------------------- capacity


def test_model_eight_times_the_budget_trains_within_it() -> None:
    vocab = 512
    config = GPT2Config(
        n_layer=8, n_embd=128, n_head=4, n_positions=64, vocab_size=vocab, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1,
    )
    generator = torch.Generator().manual_seed(1)
    spec = TrainSpec(
        model=config,
        train_data=torch.randint(0, vocab, (16, 64), generator=generator),
        optimizer=OptimizerSpec(lr=1e-3, weight_decay=0.1),
        batch_size=8,
        max_steps=2,
        seed=3,
    )
    budget = 8 * MiB
    executor = ShardExecutor(f"cpu:1x{budget}", microbatch_size=2)
    device = executor.devices[0]
    plan = executor.plan(spec)
    assert plan.spill and len(plan.shards) >= 4 and plan.plain_bytes >= 8 * budget
    result = executor.fit(spec)  # spills by itself
    assert result.swap_bytes > 0 and result.steps == 2
    metered = result.peak_device_bytes
    assert metered is not None and metered <= budget  # the meter would have raised past it
    memory = executor.memory_plan(spec)  # the executor plans swap / recompute by default
    assert memory is not None and memory.peak_bytes <= budget
    assert abs(memory.peak_bytes - metered) <= 0.15 * metered

    host = VirtualDevice("cpu:big", budget_bytes=1 << 40)
    with host.meter.metering():
        expected = train_plain(spec, host)
    assert host.meter.peak_bytes >= 8 * budget  # plain training really needs 8x the budget
    assert abs(plan.plain_bytes - host.meter.peak_bytes) <= 0.15 * host.meter.peak_bytes
    for name, tensor in expected.state_dict.items():  # 4 microbatches: float sums reordered
        torch.testing.assert_close(result.state_dict[name], tensor, rtol=0, atol=1e-4)
    assert device.meter.live_bytes == 0


def test_executor_trains_a_job_that_fits_as_one_resident_shard() -> None:
    spec = tiny_spec(max_steps=2)
    with ShardExecutor("cpu:1x64MiB") as executor:
        plan = executor.plan(spec)
        assert not plan.spill and len(plan.shards) == 1
        result = executor.fit(spec)
    # promoted at its first task, kept across its steps, written back after its last
    assert (result.num_promotes, result.num_demotes) == (1, 1) and result.swap_bytes > 0
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict)
    with pytest.raises(ValueError, match="spill"):
        ShardExecutor("cpu", spill="sometimes")  # type: ignore[arg-type]


def test_plan_job_for_spec() -> None:
    spec = tiny_spec()
    plan = plan_job(spec, VirtualDevice("cpu:0", budget_bytes=600_000))
    assert plan.spill and all(s.backward_peak_bytes <= 600_000 for s in plan.shards)


class ScaledRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("gain", torch.full((16,), 0.5))

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.gain


def sequential_model() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(VOCAB, 16), ScaledRelu(), nn.Dropout(0.3), ScaledRelu(), nn.Linear(16, VOCAB)
    )


def test_sequential_model_with_buffers_spills_exactly() -> None:
    spec = tiny_spec("sgd", model=sequential_model)
    profile = profile_model(spec)
    device = VirtualDevice("cpu:0", budget_bytes=MiB)
    plan = make_plan(profile, spec.optimizer, [0, 1, 3, 5], device)
    result = train_spilled(spec, device, plan)
    assert len(plan.shards) == 3 and result.swap_bytes > 0
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict)
