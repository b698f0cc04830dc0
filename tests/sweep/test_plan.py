"""``sweepmaster plan``: sweep -> jobs -> plans, the partition cache, and the CLI around them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sweepmaster.cli import app
from sweepmaster.cli.console import format_size
from sweepmaster.config import load_sweep_config
from sweepmaster.config.train_specs import TokenData, train_spec_from_config
from sweepmaster.errors import DeviceError, SweepmasterError
from sweepmaster.runtime import VirtualDevice, plan_job
from sweepmaster.runtime.planning.memplan import MemoryPlan, memory_plan_key
from sweepmaster.runtime.planning.packing import copy_bytes_per_s, make_plan
from sweepmaster.runtime.planning.plans import LayerTooLargeError
from sweepmaster.runtime.planning.profile import profile_model
from sweepmaster.runtime.training.fused_shards import (
    dropout_noise_bytes,
    plan_stacked,
    stacked_profile,
    stacked_spec,
)
from sweepmaster.store import create_store_engine, upgrade_to_head
from sweepmaster.store.partitions import count_partitions, load_partition
from sweepmaster.sweep.plan import open_devices, plan_sweep
from sweepmaster.workload import load_tokenizer
from tests.kit.lora import SPILL_BUDGET as LORA_BUDGET
from tests.kit.lora import spilled_member as lora_member
from tests.kit.sweeps import EXAMPLES, tiny_sweep, write_sweep

MiB = 2**20
SPILL_EXAMPLE = EXAMPLES / "spill-cpu.yaml"


def example_spec(config, batch_size: int):
    """The TrainSpec launch would build for one cell of the spill example (data: zeros)."""
    trial = config.with_params({"train.batch_size": batch_size, "train.lr": 1e-3})
    vocab = len(load_tokenizer(trial.data.tokenizer))
    blocks = torch.zeros((batch_size, trial.data.block_size), dtype=torch.int64)
    return train_spec_from_config(trial, TokenData(blocks, None, vocab))


def test_spill_example_plans_two_spilled_jobs_that_match_plan_job(tmp_path: Path) -> None:
    config = load_sweep_config(SPILL_EXAMPLE)
    sweep_plan = plan_sweep(config, storage=f"sqlite:///{tmp_path / 'none.db'}")
    assert (sweep_plan.name, sweep_plan.devices, sweep_plan.num_configs) == (
        "spill-cpu", ("cpu:0",), 4)
    assert [job.params for job in sweep_plan.jobs] == [{"train.batch_size": 8},
                                                       {"train.batch_size": 16}]
    assert [len(job.configs) for job in sweep_plan.jobs] == [2, 2]  # two learning rates each
    device = open_devices(config)[0]
    assert device.budget_bytes == 256 * MiB
    for job in sweep_plan.jobs:
        assert job.spill and job.plan is not None and job.error is None and not job.cached
        assert job.plain_bytes >= 3 * job.budget_bytes  # several times the device
        assert len(job.plan.shards) >= 2
        assert job.plan.peak_bytes <= job.budget_bytes
        expected = plan_job(example_spec(config, job.params["train.batch_size"]), device)
        assert [s.layer_names for s in job.plan.shards] == [s.layer_names
                                                           for s in expected.shards]
        assert [(s.param_bytes, s.optimizer_bytes, s.activation_bytes, s.backward_peak_bytes,
                 s.microbatch_size) for s in job.plan.shards] == [
            (s.param_bytes, s.optimizer_bytes, s.activation_bytes, s.backward_peak_bytes,
             s.microbatch_size) for s in expected.shards]
        assert (job.plan.plain_bytes, job.plan.num_tasks_per_step,
                job.plan.swap_bytes_per_step) == (
            expected.plain_bytes, expected.num_tasks_per_step, expected.swap_bytes_per_step)
    assert not (tmp_path / "none.db").exists()  # plan creates no database
    assert any("no database" in note for note in sweep_plan.notes)


def test_second_plan_reads_the_partition_cache(storage_url: str,
                                               counted_plans: list[str]) -> None:
    upgrade_to_head(storage_url)
    engine = create_store_engine(storage_url)
    config = load_sweep_config(SPILL_EXAMPLE)
    first = plan_sweep(config, storage=storage_url)
    assert (first.num_cache_hits, first.num_cache_saved) == (0, 2)
    assert not any(job.cached for job in first.jobs)
    assert count_partitions(engine) == 2 and len(counted_plans) == 2

    second = plan_sweep(config, storage=storage_url)
    assert (second.num_cache_hits, second.num_cache_saved) == (2, 0)
    assert all(job.cached for job in second.jobs)
    assert count_partitions(engine) == 2 and len(counted_plans) == 2  # nothing re-profiled
    assert [job.plan for job in second.jobs] == [job.plan for job in first.jobs]


def test_tpe_sweep_plans_each_value_of_parameters_that_change_the_job(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, study={"sampler": "tpe", "n_trials": 5},
                     resources={"devices": "cpu:1x4GiB"})
    raw["parameters"] = {"train.lr": {"min": 1e-4, "max": 1e-2,
                                      "distribution": "log_uniform_values"},
                         "model.config.n_layer": {"min": 1, "max": 3}}
    sweep_plan = plan_sweep(load_sweep_config(write_sweep(tmp_path, raw)))
    assert [job.params for job in sweep_plan.jobs] == [{"model.config.n_layer": n}
                                                       for n in (1, 2, 3)]
    assert all(not job.spill and len(job.plan.shards) >= 1 for job in sweep_plan.jobs)
    notes = " ".join(sweep_plan.notes)
    assert "model.config.n_layer changes the job: planned at each of its values" in notes
    assert "train.lr" not in notes


def test_layer_too_large_is_one_line_exit_2_for_plan_and_launch(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, resources={"devices": "cpu:1x16MiB"})
    path = write_sweep(tmp_path, raw)
    with pytest.raises(DeviceError) as info:
        plan_sweep(load_sweep_config(path))
    assert isinstance(info.value.__cause__, LayerTooLargeError)
    assert isinstance(LayerTooLargeError("embed", 2, 1), SweepmasterError)
    runner = CliRunner()
    for command in ("plan", "launch"):
        result = runner.invoke(app, [command, str(path)], env={"COLUMNS": "300"})
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert "layer 'embed' needs" in lines[0] and "16.0 MiB" in lines[0]
        assert str(path) in lines[0] and "Traceback" not in result.output
    # a budget capped by --device-memory: the line names that setting too
    result = runner.invoke(app, ["launch", str(path), "--devices", "cpu", "--device-memory",
                                 "1MiB"], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert "the device budget of 1.0 MiB" in result.stderr
    assert "(resources.devices, resources.device_memory; --devices, --device-memory)" \
        in result.stderr
    assert not (tmp_path / "sweep.db").exists()  # launch wrote nothing


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without that GPU")
def test_missing_gpu_is_a_launch_time_error_not_a_load_error(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, tiny_sweep(tmp_path, resources={"devices": "cuda:0"}))
    config = load_sweep_config(path)  # syntax only: valid
    assert config.resources.devices == "cuda:0"
    result = CliRunner().invoke(app, ["plan", str(path)])
    assert result.exit_code == 2
    assert "resources.devices: device spec 'cuda:0': cuda:0 requested but this machine has no" \
        in result.stderr
    result = CliRunner().invoke(app, ["launch", str(path), "--devices", "cuda:1"])
    assert result.exit_code == 2 and result.stderr.startswith("error: --devices: ")
    assert not (tmp_path / "sweep.db").exists()


def test_plan_command_prints_jobs_and_shards(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["plan", str(SPILL_EXAMPLE), "--storage", f"sqlite:///{tmp_path / 'x.db'}"],
        env={"COLUMNS": "220"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "sweep spill-cpu: 2 job(s) from 4 configuration(s) on cpu:0" in out
    assert out.count("spills") == 2 and "256.0 MiB" in out
    assert "job 1 (batch_size=8): " in out and "job 2 (batch_size=16): " in out
    for header in ("tasks/step", "swap/step", "est. step", "plain footprint", "microbatch",
                   "optimizer", "activations", "bwd peak"):
        assert header in out
    assert "embed .. " in out and ".. head (" in out
    # job 1 has no room beside its shards for kept or swapped activations; job 2 has
    assert "job 1: every activation is recomputed" in out
    assert "job 2: activations kept (K), swapped (S) or recomputed (R)" in out
    assert "recompute-all s" in out
    assert not (tmp_path / "x.db").exists()


def test_memory_plans_are_launch_s_and_kept_beside_the_partition(storage_url: str) -> None:
    upgrade_to_head(storage_url)
    config = load_sweep_config(SPILL_EXAMPLE)
    first = plan_sweep(config, storage=storage_url)
    small, large = first.jobs
    assert small.memory_plan is None  # all-recompute fits, nothing more
    assert large.memory_plan is not None and large.memory_plan.peak_bytes <= large.budget_bytes
    # (which layers swap depends on the copy bandwidth measured here: not asserted)
    assert len(large.memory_plan.summary()) == len(large.plan.shards)
    # launch's executor finds the same plan in the store, without planning again
    from sweepmaster.runtime import ShardExecutor
    from sweepmaster.store.partitions import StorePlanCache

    cache = StorePlanCache(create_store_engine(storage_url))
    executor = ShardExecutor("cpu:1x256MiB", plan_cache=cache)
    spec = example_spec(config, 16)
    assert executor.memory_plan(spec) == large.memory_plan
    assert plan_sweep(config, storage=storage_url).jobs[1].memory_plan == large.memory_plan


def test_plan_devices_option_overrides_resources(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["plan", str(SPILL_EXAMPLE), "--devices", "cpu:2x4GiB", "--storage",
              f"sqlite:///{tmp_path / 'x.db'}"], env={"COLUMNS": "220"})
    assert result.exit_code == 0, result.output
    assert "on cpu:0, cpu:1" in result.stdout and "spills" not in result.stdout
    rows = [line.split() for line in result.stdout.splitlines()
            if line.split()[:1] in (["1"], ["2"])]
    assert [row[3] for row in rows] == ["plain", "plain"]  # job, trials, parameters, trains
    result = CliRunner().invoke(app, ["plan", str(SPILL_EXAMPLE), "--device-memory", "lots"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --device-memory: expected a positive size")


def test_plan_of_a_fused_spilled_sweep_lists_the_array_s_memory_plan(tmp_path: Path) -> None:
    """Each size of spilled fused array gets the memory plan launch uses, kept per K beside
    its stacked shards in the partition cache, and ``plan`` prints it within 80 columns."""
    raw = tiny_sweep(tmp_path, resources={"fusion": 2, "devices": "cpu:1x64MiB"},
                     train={"optimizer": "sgd"})
    raw["parameters"] = {"train.lr": {"values": [1e-2, 3e-3, 1e-3]}}
    path = write_sweep(tmp_path, raw)
    config = load_sweep_config(path)
    upgrade_to_head(config.storage)
    engine = create_store_engine(config.storage)
    (job,) = plan_sweep(config).jobs
    assert job.spill and job.memory_plan is not None and job.fusion is not None
    assert job.fusion.array_sizes == (2, 1)  # one array of 2, the third trial alone
    (array,) = job.fusion.arrays
    assert array.num_members == 2 and array.stacked_plan.spill
    memory = array.memory_plan
    assert memory is not None and memory.peak_bytes <= job.budget_bytes
    assert len(memory.summary()) == len(array.stacked_plan.shards)
    assert memory.swap_bytes_per_step > job.memory_plan.swap_bytes_per_step  # two members'
    stored = load_partition(engine, memory_plan_key(job.key, 2), job.budget_bytes, "cpu",
                            "memory_plan_json")
    assert stored is not None and MemoryPlan.from_json(stored) == memory
    assert count_partitions(engine) == 2  # the job's partition, the array's stacked shards

    # launch's executor finds the array's plan in the store, without tracing it again
    from sweepmaster.runtime import ShardExecutor
    from sweepmaster.store.partitions import StorePlanCache

    cache = StorePlanCache(engine)
    spec = example_spec(config, 4)
    with ShardExecutor("cpu:1x64MiB", plan_cache=cache) as executor:
        assert executor.memory_plan(spec, 2) == memory
    assert cache.num_memory_hits == 1

    result = CliRunner().invoke(app, ["plan", str(path)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    words = " ".join(out.split())
    assert "fused array of 2 (stacked shards)" in words
    assert ("job 1 (fused array of 2): activations kept (K), swapped (S) or recomputed (R)"
            in words)
    assert f"{format_size(memory.swap_bytes_per_step)} swapped per step" in words
    assert words.count("recompute-all s") == 2  # the single trial's plan and the array's
    assert max(len(line) for line in out.splitlines()) <= 80, out


def test_a_stacked_plan_s_swap_volume_and_seconds_count_what_its_passes_promote() -> None:
    # LoRA members with dropout, spilled: every pass of a stacked shard promotes the members'
    # dropout noise and scalings. The plan counts them in its swap volume per step and in its
    # estimated seconds, as the same shards planned without them plus their copy time.
    spec = stacked_spec([lora_member(2, 8.0, 0.1, 1e-2), lora_member(8, 4.0, 0.0, 3e-3),
                         lora_member(4, 16.0, 0.05, 1e-2)])
    device = VirtualDevice("cpu:plan", budget_bytes=LORA_BUDGET)
    profile = profile_model(spec, 2)
    plan = plan_stacked(spec, 3, device, profile=profile)
    assert plan.spill and len(plan.shards) == 4
    # scalings go only with shards holding adapters (not the base's embeddings or head)
    assert [shard.scaling_bytes for shard in plan.shards] == [0, 3 * 4, 3 * 4, 0]
    assert plan.swap_bytes_per_step == plan.step_swap_bytes()
    bare = make_plan(stacked_profile(profile, 3, dropout_noise_bytes(spec)), spec.optimizer,
                     [0, *(shard.stop for shard in plan.shards)], device,
                     microbatch_sizes=[shard.microbatch_size for shard in plan.shards],
                     prefetch_margin=plan.prefetch_margin)
    assert not any(shard.scaling_bytes or any(shard.noise_bytes) for shard in bare.shards)
    moved = plan.swap_bytes_per_step - bare.swap_bytes_per_step
    assert moved > 0
    assert plan.step_s - bare.step_s == pytest.approx(moved / copy_bytes_per_s("cpu"))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_planned_optimizer_scratch_is_what_a_foreach_step_allocates(optimizer) -> None:
    """The step's scratch in a plan equals a real foreach step's metered peak (to 1 KiB)."""
    import dataclasses

    from sweepmaster.runtime.devices.meter import VirtualMeter
    from sweepmaster.runtime.planning.profile import optimizer_step_bytes, plain_footprint_bytes
    from sweepmaster.runtime.training.plain import build_optimizer
    from sweepmaster.workload.causal_lm import build_model
    from tests.kit.spill import OPTIMIZERS, tiny_spec

    spec = tiny_spec(optimizer, optimizer=dataclasses.replace(
        OPTIMIZERS[optimizer], grad_clip=None))
    model = build_model(spec.model, spec.dtype, spec.peft)
    params = [p for p in model.parameters() if p.requires_grad]
    step = build_optimizer(params, spec.optimizer)
    step.param_groups[0]["foreach"] = True  # CUDA's default path, taken on the CPU
    for param in params:
        param.grad = torch.randn_like(param)
    step.step()  # makes the state
    meter = VirtualMeter(1 << 40, "test")
    for tensor in [*params, *(p.grad for p in params),
                   *(v for s in step.state.values() for v in s.values() if v.dim() > 0)]:
        meter.track(tensor)
    base = meter.live_bytes
    with meter.metering():
        step.step()
    measured = meter.peak_bytes - base

    profile = profile_model(spec)
    trainable = sum(profile.param_bytes.values())
    state = base - 2 * trainable
    footprint = plain_footprint_bytes(profile.param_bytes, 0, spec.optimizer, foreach=True)
    planned = footprint - 2 * trainable - state
    assert planned == optimizer_step_bytes(profile.param_bytes.values(), foreach=True)
    assert abs(planned - measured) <= 1024, (planned, measured)
    assert measured > 2 * max(profile.param_bytes.values())  # what the old model said


def test_plan_says_where_each_spilled_job_updates_and_the_bytes_each_way(tmp_path: Path) -> None:
    sweep_plan = plan_sweep(load_sweep_config(SPILL_EXAMPLE),
                            storage=f"sqlite:///{tmp_path / 'none.db'}")
    for job in sweep_plan.jobs:
        assert job.spill and job.update is not None
        # a virtual device's "device" is the host's own CPU: the plan keeps the device update
        assert (job.plan.update_on, job.update.update_on) == ("device", "device")
        assert job.update.reason == "virtual device: one CPU"
        shards = job.plan.shards
        assert job.update.device_bytes == sum(2 * s.optimizer_bytes + s.owned_param_bytes
                                              for s in shards)
        assert job.update.host_bytes == sum(s.owned_param_bytes for s in shards)
        assert 0 < job.update.host_bytes < job.update.device_bytes
    result = CliRunner().invoke(app, ["plan", str(SPILL_EXAMPLE), "--storage",
                                      f"sqlite:///{tmp_path / 'none.db'}"],
                                env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    words = " ".join(result.stdout.split())
    assert words.count(" update device ") == len(sweep_plan.jobs)  # the jobs table's column
    for job in sweep_plan.jobs:
        assert (f"job {job.number}: updates on the device (virtual device: one CPU); per step "
                f"the device update moves {format_size(job.update.device_bytes)} (optimizer "
                f"state up and down, parameters back), the host update "
                f"{format_size(job.update.host_bytes)} (gradients home)") in words


def test_resources_update_on_host_moves_the_updates_of_every_spilled_job(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'none.db'}"
    device_plan = plan_sweep(load_sweep_config(SPILL_EXAMPLE), storage=storage)
    host_plan = plan_sweep(load_sweep_config(SPILL_EXAMPLE, ["resources.update_on=host"]),
                           storage=storage)
    for device_job, host_job in zip(device_plan.jobs, host_plan.jobs, strict=True):
        assert (host_job.plan.update_on, host_job.update.reason) == ("host", "forced")
        state = sum(s.optimizer_bytes for s in host_job.plan.shards)
        # no optimizer state moves; the gradients go home where parameters were written back
        assert (device_job.plan.swap_bytes_per_step - host_job.plan.swap_bytes_per_step
                == 2 * state)
    result = CliRunner().invoke(app, ["plan", str(SPILL_EXAMPLE), "--storage", storage,
                                      "--set", "resources.update_on=host"],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    words = " ".join(result.stdout.split())
    assert words.count("updates on the host (forced); per step") == len(host_plan.jobs)
    bad = CliRunner().invoke(app, ["plan", str(SPILL_EXAMPLE), "--set",
                                   "resources.update_on=cpu"])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "resources.update_on: expected one of 'auto', 'device', 'host'" in bad.stderr
