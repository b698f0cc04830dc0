"""LoRA trials fused over one base that spills: the base once per shard task, adapters stacked."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from sweepmaster.config import parse_sweep_config
from sweepmaster.runtime import Device, ShardExecutor, TrainCallbacks, train_plain
from sweepmaster.runtime.devices.device import VirtualDevice
from sweepmaster.runtime.planning.profile import profile_model
from sweepmaster.runtime.training.fused_memplan import plan_stacked_memory
from sweepmaster.runtime.training.fused_shards import plan_stacked, stacked_profile, stacked_spec
from sweepmaster.runtime.training.fused_spill import SpilledFusedJob, train_fused_spilled
from sweepmaster.sweep import run_sweep
from sweepmaster.workload import OptimizerSpec
from tests.kit.fused import MARKS
from tests.kit.lora import SPILL_BUDGET as BUDGET
from tests.kit.lora import SPILLED_MEMBERS as MEMBERS
from tests.kit.lora import PruneAt2, assert_equals_alone, max_abs_diff
from tests.kit.spill import MiB
from tests.kit.sweeps import tiny_sweep
from tests.runtime.test_lora_fusion import assert_one_array_whose_adapters_reload

pytestmark = MARKS

CPU = Device("cpu")


def test_the_planner_charges_the_base_once_and_the_adapters_k_times() -> None:
    spec = stacked_spec(MEMBERS)
    assert spec.peft is not None and (spec.peft.r, spec.peft.dropout) == (8, 0.1)
    assert spec.optimizer.grad_clip == 0.05  # a clipping member: its deferred updates need room
    profile = profile_model(spec)
    assert profile.frozen_param_bytes and profile.param_bytes
    stacked = stacked_profile(profile, 4)
    assert stacked.frozen_param_bytes == profile.frozen_param_bytes
    assert stacked.param_bytes == {n: 4 * b for n, b in profile.param_bytes.items()}
    for one, four in zip(profile.layers, stacked.layers, strict=True):
        assert four.frozen_param_names == one.frozen_param_names
        assert four.saved_bytes == 4 * one.saved_bytes
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    full = dataclasses.replace(spec, peft=None)
    lora_plan, full_plan = plan_stacked(spec, 4, device), plan_stacked(full, 4, device)
    assert lora_plan.spill and full_plan.spill
    assert len(lora_plan.shards) < len(full_plan.shards)
    assert lora_plan.plain_bytes < full_plan.plain_bytes


def test_a_memory_plan_traced_on_one_member_of_a_stacked_plan_is_refused() -> None:
    # The stacked plan pads every adapter to rank 8; the rank-2 member's traced layers save
    # smaller adapter activations, so a memory plan traced on it offloads 6,912 B less per
    # microbatch of each block than the array does (13,824 B per forward task at b = 2).
    planned = stacked_spec(MEMBERS)
    plan = plan_stacked(planned, 3, VirtualDevice("cpu:plan", budget_bytes=BUDGET),
                        microbatch_size=2)
    with pytest.raises(ValueError, match="stacked_spec"):
        plan_stacked_memory(MEMBERS[0], 3, plan, bandwidth=1e9, budget_bytes=1 << 40)
    memory = plan_stacked_memory(planned, 3, plan, bandwidth=1e9, budget_bytes=1 << 40)
    assert [s.layer_names for s in memory.shards] == [s.layer_names for s in plan.shards]


def test_spilled_lora_members_end_with_the_adapters_of_training_each_alone() -> None:
    """Ranks differ, dropout is on, one member clips, one is pruned after step 2."""
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    plan = plan_stacked(stacked_spec(MEMBERS), len(MEMBERS), device, microbatch_size=2)
    assert len(plan.shards) >= 3 and plan.shards[0].stop == 1  # the embeddings alone
    callbacks = [None, PruneAt2(), None]
    results = train_fused_spilled(MEMBERS, device, plan, callbacks)
    diffs = [assert_equals_alone(result, spec, cb)
             for result, spec, cb in zip(results, MEMBERS, callbacks, strict=True)]
    print(f"max abs diff per member vs train_plain: {diffs}")
    assert results[1] is not None and results[1].pruned and results[1].steps == 2
    unclipped = train_plain(dataclasses.replace(MEMBERS[2], optimizer=OptimizerSpec(
        lr=1e-2, weight_decay=0.1)), CPU)  # the clip is active: it changes the adapter
    assert results[2] is not None
    assert max_abs_diff(results[2].state_dict, unclipped.state_dict) > 1e-4
    for result in results:
        assert result is not None
        assert result.peak_device_bytes is not None and result.peak_device_bytes <= BUDGET


def test_the_base_is_held_once_promoted_once_per_task_and_never_written_back() -> None:
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    specs = [dataclasses.replace(spec, eval_data=None, eval_every=None, max_steps=2)
             for spec in MEMBERS[:2]]
    plan = plan_stacked(stacked_spec(specs), 2, device, microbatch_size=2)
    job = SpilledFusedJob(specs, plan)
    held = job.members.stacked
    assert held.frozen and all(".lora_" not in name for name in held.frozen)
    assert set(held.params) and all(".lora_" in name for name in held.params)
    for name, stacked in held.params.items():  # (K, ...) padded to R = 8
        assert stacked.shape[0] == 2 and 8 in stacked.shape[1:], name
    base = {name: tensor.clone() for name, tensor in held.frozen.items()}
    ids = {name: id(tensor) for name, tensor in held.frozen.items()}
    frozen_bytes = [sum(held.frozen[n].nbytes for n in names)
                    for names in held.shard_frozen]
    while (task := job.next_task()) is not None:
        before = job.boundaries.swap_bytes
        job.run(task, device)
        moved = job.boundaries.swap_bytes - before
        assert moved >= frozen_bytes[task.shard]  # the base of the shard, once, for 2 members
    assert job.store.num_promotes == job.store.num_demotes > 0
    for name, tensor in held.frozen.items():  # never demoted, never changed
        assert id(tensor) == ids[name] and torch.equal(tensor, base[name])
    for optimizer, owned in zip(held.optimizers, held.owned, strict=True):
        assert all(".lora_" in name for name in owned)  # no optimizer state for the base
        if optimizer is None:
            assert not owned


def test_the_executor_fuses_spilled_lora_trials_and_saves_each_adapter(tmp_path: Path) -> None:
    specs = [dataclasses.replace(spec, checkpoint_dir=tmp_path / spec.name)
             for spec in MEMBERS[:2]]
    with ShardExecutor(f"cpu:1x{BUDGET}", spill="always", fusion=2) as executor:
        choice = executor.fusion_choice(specs[0])
        assert (choice.k, choice.source) == (2, "fixed")  # LoRA trials that spill now fuse
        assert choice.stacked_plan is not None and choice.stacked_plan.spill
        results = [f.result() for f in executor.submit_fused(specs, name="lora-array")]
    for spec, result in zip(specs, results, strict=True):
        assert_equals_alone(result, dataclasses.replace(spec, checkpoint_dir=None))
        assert result.checkpoint_path is not None
        saved = sorted(p.name for p in Path(result.checkpoint_path).iterdir())
        assert saved == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.slow
def test_a_lora_sweep_that_spills_fuses_its_trials_and_their_adapters_reload(
    tmp_path: Path,
) -> None:
    # a base whose blocks weigh beside its 50257-token head: one trial needs 148 MiB, so at
    # 96 MiB it spills, and two trials' stacked head (86 MiB) still fits
    model = {"config": {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 32},
             "peft": {"r": 2, "alpha": 8, "dropout": 0.05}}
    raw = tiny_sweep(tmp_path, model=model, resources={"fusion": 2, "devices": "cpu:1x96MiB"},
                     output={"dir": str(tmp_path / "checkpoints"), "save": "all"})
    raw["parameters"] = {"model.peft.r": {"values": [2, 4]}}
    config = parse_sweep_config(raw)
    outcome = run_sweep(config)
    assert (outcome.num_finished, outcome.num_failed) == (2, 0)
    assert_one_array_whose_adapters_reload(raw, config)


def test_killed_lora_members_resume_from_their_unpadded_checkpoints(tmp_path: Path) -> None:
    """Checkpoints of a spilled LoRA array hold each member's own (unpadded) adapter and AdamW
    state: the array and plain training both resume from them to the uninterrupted weights."""

    class Kill(BaseException):
        pass

    class KillAt3(TrainCallbacks):
        def on_step(self, event):
            if event.step == 3:
                raise Kill

    class Starts(TrainCallbacks):
        def __init__(self) -> None:
            self.resumed: list[int] = []

        def on_start(self, event):
            self.resumed.append(event.resumed_from_step)

    specs = [dataclasses.replace(spec, state_dir=tmp_path / spec.name, checkpoint_every=2)
             for spec in MEMBERS[:2]]  # ranks 2 and 8
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    plan = plan_stacked(stacked_spec(specs), 2, device, microbatch_size=2)
    with pytest.raises(Kill):
        train_fused_spilled(specs, device, plan, [KillAt3(), None])
    copies = [tmp_path / f"copy-{spec.name}" for spec in specs]  # the step-2 checkpoints
    for spec, copy in zip(specs, copies, strict=True):
        shutil.copytree(spec.state_dir, copy)
    resumed = train_fused_spilled(specs, device, plan)
    for spec, result, copy in zip(specs, resumed, copies, strict=True):
        alone = dataclasses.replace(spec, state_dir=None, checkpoint_every=None)
        assert_equals_alone(result, alone)
        starts = Starts()
        from_checkpoint = train_plain(dataclasses.replace(alone, state_dir=copy), CPU, starts)
        assert starts.resumed == [2]
        assert_equals_alone(from_checkpoint, alone)
