"""LoRA trials fused over one shared frozen base: exactness, padding, sharing, PEFT saving."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from sweepmaster.config import parse_sweep_config
from sweepmaster.runtime import Device, train_plain
from sweepmaster.runtime.training.fused_shards import plan_stacked, stacked_spec
from sweepmaster.runtime.training.fused_spill import SpilledFusedJob
from sweepmaster.runtime.training.plain import evaluate_loss
from sweepmaster.runtime.training.training_state import job_key, save_checkpoint
from sweepmaster.store import create_store_engine, get_sweep
from sweepmaster.store.fusion import fusion_groups
from sweepmaster.sweep import run_sweep
from sweepmaster.workload import LoraSpec, TrainSpec, build_model
from sweepmaster.workload.architecture import fusion_group_key, group_for_fusion
from tests.kit.fused import train_array
from tests.kit.lora import CONFIG, VALID, member
from tests.kit.sweeps import tiny_sweep
from tests.workload.test_lora import reload_saved_adapters

pytestmark = pytest.mark.usefixtures("one_thread")


#: Ranks, alphas, dropouts (0: PEFT's identity) and learning rates all differ.
MEMBERS = [member(2, 8.0, 0.1, 1e-2), member(8, 4.0, 0.0, 3e-3), member(4, 16.0, 0.05, 1e-2)]


def fitting_array(specs: list[TrainSpec], device: Device | None = None,
                  **kwargs) -> SpilledFusedJob:
    """The job the executor trains for an array that fits its device: one stacked shard."""
    device = device if device is not None else Device("cpu")
    planned = kwargs.get("planned") or stacked_spec(specs)
    return SpilledFusedJob(specs, plan_stacked(planned, len(specs), device, whole=True), **kwargs)


def lora_names(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def test_each_fused_lora_member_ends_with_the_weights_of_training_it_alone() -> None:
    results = train_array(MEMBERS)
    for spec, result in zip(MEMBERS, results, strict=True):
        expected = train_plain(spec, Device("cpu"))
        assert result.state_dict.keys() == expected.state_dict.keys()
        for name, tensor in expected.state_dict.items():  # unpadded: the member's own shapes
            torch.testing.assert_close(result.state_dict[name], tensor, rtol=1e-5, atol=1e-5,
                                       msg=name)
        for metric in ("train_loss", "eval_loss"):
            got, want = result.history(metric), expected.history(metric)
            assert [step for step, _ in got] == [step for step, _ in want]
            assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5)


def test_padding_to_the_largest_rank_stays_exactly_zero_through_adamw_with_weight_decay() -> None:
    array = fitting_array(MEMBERS)
    for _ in range(4):
        array.run_step(Device("cpu"))
    ranks = [spec.peft.r for spec in MEMBERS if spec.peft is not None]
    assert ranks == [2, 8, 4]
    names = sorted(array.members.stacked.params)
    assert names and all(".lora_" in name for name in names)
    state = array.members.member_training_state(0).optimizer
    for name in names:
        stacked = array.members.stacked.params[name]
        is_a = ".lora_A." in name
        assert stacked.shape[1 if is_a else 2] == 8  # padded to R
        for k, r in enumerate(ranks):
            padding = stacked[k, r:] if is_a else stacked[k, :, r:]
            assert padding.numel() == 0 or torch.count_nonzero(padding) == 0, name
            used = stacked[k, :r] if is_a else stacked[k, :, :r]
            if not is_a:  # B starts at zero; it has trained
                assert torch.count_nonzero(used) > 0, name
        for moment in ("exp_avg", "exp_avg_sq"):  # the member's state is its own, unpadded
            assert state[name][moment].shape == (
                (2, stacked.shape[2]) if is_a else (stacked.shape[1], 2))


def test_the_frozen_base_is_held_once_and_only_adapters_are_stacked() -> None:
    leaving = [MEMBERS[0], TrainSpec(**{**MEMBERS[1].__dict__, "max_steps": 1}), MEMBERS[2]]
    array = fitting_array(leaving)
    plain = build_model(CONFIG, peft=MEMBERS[1].peft)  # rank 8, the array's R
    trainable = lora_names(plain)
    shapes = {name: p.shape for name, p in plain.named_parameters()}
    assert set(array.members.stacked.params) == trainable
    assert set(array.members.stacked.frozen) == set(shapes) - trainable
    for name, tensor in array.members.stacked.frozen.items():  # one copy, not (K, ...)
        assert tensor.shape == shapes[name] and not tensor.requires_grad
    for name, stacked in array.members.stacked.params.items():
        assert stacked.shape == (len(MEMBERS), *shapes[name])
    frozen_bytes = sum(t.numel() * t.element_size() for t in array.members.stacked.frozen.values())
    base_bytes = sum(p.numel() * p.element_size() for n, p in plain.named_parameters()
                     if n not in trainable)
    assert frozen_bytes == base_bytes
    array.run_step(Device("cpu"))
    array.run_step(Device("cpu"))  # the largest rank left after step 1; the others go on
    assert array.members.stacked.num_members == 2 and array.members.step == 2
    assert set(array.members.stacked.frozen) == set(shapes) - trainable


def test_each_fused_adapter_saves_in_peft_format_and_loads_to_its_eval_loss(
    tmp_path: Path,
) -> None:
    specs = [TrainSpec(**{**spec.__dict__, "checkpoint_dir": tmp_path / spec.name})
             for spec in MEMBERS]
    results = train_array(specs)
    for spec, result in zip(specs, results, strict=True):
        assert spec.peft is not None and result.checkpoint_path is not None
        folder = Path(result.checkpoint_path)
        saved = json.loads((folder / "adapter_config.json").read_text())
        assert (saved["r"], saved["lora_alpha"], saved["lora_dropout"]) == (
            spec.peft.r, spec.peft.alpha, spec.peft.dropout)
        torch.manual_seed(spec.seed)  # the base the members shared
        base = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIG))
        model = PeftModel.from_pretrained(base, folder)
        loaded = model.base_model.model.state_dict()
        for name, tensor in result.state_dict.items():
            assert torch.equal(loaded[name], tensor), name
        loss = evaluate_loss(model, VALID, spec.batch_size, Device("cpu"))
        assert loss == pytest.approx(result.history("eval_loss")[-1][1], rel=1e-6)


def test_lora_trials_group_over_one_base_whatever_their_rank_alpha_dropout_and_lr() -> None:
    others = [
        member(4, 8.0, 0.1, 1e-2, peft=LoraSpec(r=4, target_modules=("c_attn",))),  # targets
        member(4, 8.0, 0.1, 1e-2, seed=6),  # another base: drawn from another seed
        member(4, 8.0, 0.1, 1e-2, peft=None),  # full fine-tuning
    ]
    specs = [*MEMBERS, *others]
    assert group_for_fusion(specs, max_k=8) == [[0, 1, 2], [3], [4], [5]]
    assert len({fusion_group_key(spec) for spec in specs}) == 4
    with pytest.raises(ValueError, match="share one architecture key"):
        fitting_array([MEMBERS[0], others[1]])


def test_a_fused_lora_array_resumes_exactly_from_its_members_unpadded_training_states(
    tmp_path: Path,
) -> None:
    array = fitting_array(MEMBERS)
    for _ in range(2):
        array.run_step(Device("cpu"))
    states = [array.members.member_training_state(k) for k in range(len(MEMBERS))]
    for spec, state in zip(MEMBERS, states, strict=True):  # what the member alone would hold
        plain = build_model(CONFIG, peft=spec.peft)
        shapes = {name: p.shape for name, p in plain.named_parameters() if p.requires_grad}
        assert {name: t.shape for name, t in state.model.items() if name in shapes} == shapes
        assert {name: entry["exp_avg"].shape for name, entry in state.optimizer.items()} == shapes
    for _ in range(2):
        array.run_step(Device("cpu"))
    resuming = [TrainSpec(**{**spec.__dict__, "state_dir": tmp_path / spec.name})
                for spec in MEMBERS]
    for spec, state in zip(resuming, states, strict=True):
        assert spec.state_dir is not None
        save_checkpoint(spec.state_dir, state, job_key(spec))
    resumed = fitting_array(resuming)
    assert resumed.members.stacked.resumed_from_step == [2, 2, 2]
    for _ in range(2):
        resumed.run_step(Device("cpu"))
    for name, stacked in array.members.stacked.params.items():
        assert torch.equal(resumed.members.stacked.params[name], stacked), name


def test_a_sweep_fuses_lora_trials_of_two_ranks_and_saves_each_adapter(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, model={**tiny_sweep(tmp_path)["model"],
                                      "peft": {"r": 2, "alpha": 8, "dropout": 0.05}},
                     resources={"fusion": 2},
                     output={"dir": str(tmp_path / "checkpoints"), "save": "all"})
    raw["parameters"] = {"model.peft.r": {"values": [2, 4]}}
    config = parse_sweep_config(raw)
    assert run_sweep(config).num_finished == 2
    assert_one_array_whose_adapters_reload(raw, config)


def assert_one_array_whose_adapters_reload(raw: dict, config) -> None:
    """Trials 0 and 1 trained as one array; each saved adapter reloads to its trial's value."""
    engine = create_store_engine(config.storage)
    groups = fusion_groups(engine, get_sweep(engine, "tiny").id)
    assert sorted(sorted(members) for members in groups.values()) == [[0, 1]]  # one array
    for trial, _, saved, loss in reload_saved_adapters(raw, config):
        assert saved["r"] == trial.params["model.peft.r"]
        assert loss == pytest.approx(trial.value, rel=1e-6)


def test_the_fused_estimate_holds_the_base_once_and_bounds_the_metered_peak() -> None:
    """``fused_bytes_estimate`` of K LoRA members: above the metered peak, by at most 15%."""
    from sweepmaster.runtime import VirtualDevice
    from sweepmaster.runtime.planning.fusion_degree import fused_bytes_estimate
    from sweepmaster.runtime.planning.partition import plan_job

    specs = [member(8, 16.0, 0.1, 1e-3 * (k + 1)) for k in range(4)]
    plan = plan_job(specs[0], VirtualDevice("cpu:1", budget_bytes=2**30))
    frozen = sum(s.param_bytes - s.owned_param_bytes for s in plan.shards)
    assert frozen > 0
    for k in (2, 4):
        device = VirtualDevice("cpu:0", budget_bytes=2**30)
        array = fitting_array(specs[:k], device)
        with device.meter.metering():
            array.run_step(device, keep=True)
            array.run_step(device, keep=True)
        peak = device.meter.peak_bytes
        array.store.release()
        estimate = fused_bytes_estimate(plan, k)
        assert peak <= estimate <= 1.15 * peak, (k, peak, estimate)
    # the base counted once: each member more adds its footprint without the base
    growth = fused_bytes_estimate(plan, 4) - fused_bytes_estimate(plan, 2)
    assert growth == pytest.approx(2 * (plan.plain_bytes - frozen) * 1.05, abs=2)


def test_k_of_a_space_with_ranks_4_and_64_is_sized_for_rank_64(tmp_path: Path) -> None:
    """A rank-4 trial may found an array that rank-64 trials join: K is chosen for rank 64."""
    from sweepmaster.config.train_specs import prepare_data, train_spec_from_config, widest_member
    from sweepmaster.runtime import ShardExecutor, VirtualDevice
    from sweepmaster.runtime.planning.fusion_degree import fused_bytes_estimate
    from sweepmaster.runtime.planning.partition import plan_job

    raw = tiny_sweep(tmp_path, model={**tiny_sweep(tmp_path)["model"],
                                      "peft": {"r": 4, "alpha": 8, "dropout": 0.0}},
                     resources={"fusion": 4}, study={"sampler": "random", "n_trials": 4})
    raw["parameters"] = {"model.peft.r": {"values": [4, 64]},
                         "model.peft.dropout": {"min": 0.0, "max": 0.1}}
    config = parse_sweep_config(raw)
    trial = config.with_params({"model.peft.r": 4, "model.peft.dropout": 0.0})
    spec = train_spec_from_config(trial, prepare_data(trial), "trial-0")
    widest = widest_member(config, spec)
    assert spec.peft is not None and widest.peft is not None
    assert (widest.peft.r, widest.peft.dropout, widest.peft.alpha) == (64, 0.1, spec.peft.alpha)
    assert widest_member(config, widest) is widest  # nothing in the space is wider
    # a budget that holds 4 members of rank 4 (what sizing by this trial alone would give)
    probe = VirtualDevice("cpu:9", budget_bytes=2**40)
    narrow, wide = plan_job(spec, probe), plan_job(widest, probe)
    budget = fused_bytes_estimate(narrow, 4)
    fitting = max(k for k in range(1, 5) if fused_bytes_estimate(wide, k) <= budget)
    assert fitting < 4
    with ShardExecutor([VirtualDevice("cpu:0", budget_bytes=budget)], fusion=4) as executor:
        assert executor.fusion_choice(spec).k == 4
        choice = executor.fusion_choice(widest)
        assert (choice.k, choice.source) == (fitting, "capped")
        plan = executor.plan(widest)
        assert fused_bytes_estimate(plan, fitting) <= budget < \
            fused_bytes_estimate(plan, fitting + 1)
        # arrays of the group are now estimated at rank 64: 4 rank-4 founders are refused
        with pytest.raises(ValueError, match="fuse fewer"):
            executor.submit_fused([spec] * 4)
    # plan says what launch will do, for the rank-4 job as for the rank-64 one
    from sweepmaster.sweep.plan import plan_sweep

    planned = plan_sweep(config, devices="cpu:1x1GiB", device_memory=budget, use_cache=False)
    assert {job.params.get("model.peft.r") for job in planned.jobs} >= {4, 64}
    assert {(job.fusion.k, job.fusion.source) for job in planned.jobs
            if job.fusion is not None} == {(fitting, "capped")}



def test_members_built_over_shared_bases_equal_members_built_alone_bit_for_bit() -> None:
    from sweepmaster.runtime.training.members import SharedBases, build_member

    full = member(2, 8.0, 0.1, 1e-2, peft=None, name="full")
    half = member(4, 16.0, 0.05, 1e-2, dtype="bfloat16", name="bf16")
    other_seed = member(8, 4.0, 0.0, 3e-3, seed=6, name="seed6")
    specs = [*MEMBERS, full, half, other_seed, MEMBERS[0]]
    bases = SharedBases()
    built = [build_member(spec, torch.device("cpu"), bases) for spec in specs]
    # a member that owns its base may be overwritten (a checkpoint loaded) without touching it
    owned, _ = build_member(MEMBERS[1], torch.device("cpu"), bases, own_base=True)
    with torch.no_grad():
        for p in owned.parameters():
            p.fill_(7.0)
    built.append(build_member(MEMBERS[2], torch.device("cpu"), bases))
    specs.append(MEMBERS[2])
    for spec, (model, generator) in zip(specs, built, strict=True):
        alone, alone_generator = build_member(spec, torch.device("cpu"))
        assert type(model) is type(alone)
        assert model.state_dict().keys() == alone.state_dict().keys()
        for name, tensor in alone.state_dict().items():
            assert tensor.dtype == model.state_dict()[name].dtype, name
            assert torch.equal(model.state_dict()[name], tensor), (spec.name, name)
        assert lora_names(model) == lora_names(alone)
        assert torch.equal(generator.get_state(), alone_generator.get_state())
    # members of one base (seed 5, float32) share its tensors; the other seed does not
    base_name = "transformer.wte.weight"
    pointer = built[0][0].state_dict()[base_name].data_ptr()
    assert built[1][0].state_dict()[base_name].data_ptr() == pointer
    assert built[3][0].state_dict()[base_name].data_ptr() == pointer
    assert built[5][0].state_dict()[base_name].data_ptr() != pointer


def test_a_lora_array_builds_its_base_once_and_a_joining_member_of_it_none(monkeypatch) -> None:
    from sweepmaster.runtime.training import members as members_module

    built: list[int] = []
    build_base = members_module.build_base

    def counted_build_base(*args, **kwargs) -> torch.nn.Module:
        built.append(1)
        return build_base(*args, **kwargs)

    monkeypatch.setattr(members_module, "build_base", counted_build_base)
    leaving = TrainSpec(**{**MEMBERS[1].__dict__, "max_steps": 1})  # frees a slot at step 1
    array = fitting_array([MEMBERS[0], leaving], planned=stacked_spec(MEMBERS))
    assert len(built) == 1
    # the kept base is the array's frozen base
    assert array.members.stacked._bases.shares(array.members.stacked.frozen)
    array.run_step(Device("cpu"))
    while (task := array.next_task()) is not None and task.phase != "train":
        array.run(task, Device("cpu"))  # the step's evaluation: the boundary a join waits for
    assert array.members.stacked.num_members == 1
    with pytest.raises(ValueError, match="cannot join"):  # another base: refused, unbuilt
        array.members.stacked.join(member(4, 16.0, 0.05, 1e-2, seed=6))
    array.members.stacked.join(MEMBERS[2])
    assert len(built) == 1
