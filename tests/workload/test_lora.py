"""LoRA adapters (PEFT) over a frozen base: exactness, planning, saving, configuration."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from sweepmaster.cli import app
from sweepmaster.config import SweepConfig, load_sweep_config, parse_sweep_config
from sweepmaster.config.train_specs import prepare_data
from sweepmaster.errors import ConfigError
from sweepmaster.runtime import (
    Device,
    ShardExecutor,
    VirtualDevice,
    make_plan,
    plan_memory,
    profile_model,
    train_plain,
    train_spilled,
)
from sweepmaster.runtime.planning.pilot import pilot_pass
from sweepmaster.runtime.training.plain import evaluate_loss
from sweepmaster.sweep import run_sweep
from sweepmaster.sweep.plan import plan_sweep
from sweepmaster.workload import LoraSpec, OptimizerSpec, TrainSpec, build_model
from sweepmaster.workload.configs import model_config_from_mapping
from tests.kit.lora import blocks, tiny_config
from tests.kit.sweeps import tiny_sweep, write_sweep

MiB = 2**20
LORA = LoraSpec(r=4, alpha=8.0, dropout=0.1, target_modules=("c_attn", "c_proj"))

pytestmark = pytest.mark.usefixtures("one_thread")


def lora_spec(**overrides) -> TrainSpec:
    kwargs = {"model": tiny_config(), "train_data": blocks(12, 1), "eval_data": blocks(4, 2),
              "optimizer": OptimizerSpec(lr=1e-2, weight_decay=0.1), "batch_size": 4,
              "max_steps": 4, "eval_every": 2, "seed": 5, "peft": LORA}
    return TrainSpec(**{**kwargs, **overrides})


def initial_weights(spec: TrainSpec) -> dict[str, torch.Tensor]:
    torch.manual_seed(spec.seed)
    return build_model(spec.model, spec.dtype, spec.peft).state_dict()


# ---------------------------------------------------------------- exactness


def test_a_lora_trial_equals_a_hand_written_peft_loop_and_changes_only_the_adapter() -> None:
    spec = lora_spec(eval_data=None)
    result = train_plain(spec, Device("cpu"))

    torch.manual_seed(spec.seed)  # the reference: transformers + peft, by hand
    base = AutoModelForCausalLM.from_config(copy.deepcopy(spec.model))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                            target_modules=["c_attn", "c_proj"]))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    order = torch.Generator().manual_seed(spec.seed)
    losses = []
    perm = torch.randperm(12, generator=order)
    for step in range(spec.total_steps):
        if step == 3:
            perm = torch.randperm(12, generator=order)  # a new epoch every 3 steps
        index = perm[(step % 3) * 4:(step % 3 + 1) * 4]
        input_ids = spec.train_data[index]
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    expected = model.base_model.model.state_dict()
    assert result.state_dict.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(result.state_dict[name], tensor, rtol=1e-5, atol=1e-6,
                                   msg=name)
    assert [v for _, v in result.history("train_loss")] == pytest.approx(losses, rel=1e-5)

    start = initial_weights(spec)
    changed = {name for name, tensor in result.state_dict.items()
               if not torch.equal(tensor, start[name])}
    assert changed and all(".lora_" in name for name in changed)  # the base is untouched
    assert {n for n in changed if "lora_B" in n} == {n for n in start if "lora_B" in n}


@pytest.mark.parametrize("memory_planned", [False, True], ids=["recompute", "memory-plan"])
def test_spilled_lora_equals_plain_lora_and_promotes_the_frozen_base(
    memory_planned: bool,
) -> None:
    spec = lora_spec()
    budget = 4 * MiB
    device = VirtualDevice("cpu:0", budget_bytes=budget)
    profile = profile_model(spec)
    plan = make_plan(profile, spec.optimizer, [0, 1, 2, 3, 4], device)  # embed | 2 blocks | head
    memory = plan_memory(spec, plan, device=device) if memory_planned else None
    result = train_spilled(spec, device, plan, memory_plan=memory)
    expected = train_plain(spec, Device("cpu"))

    for name, tensor in expected.state_dict.items():
        assert torch.equal(result.state_dict[name], tensor), name
    assert result.history("eval_loss") == expected.history("eval_loss")
    model = build_model(spec.model, spec.dtype, spec.peft)
    nbytes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    for shard in plan.shards:  # the frozen base is promoted with its layers, never updated
        layers = [f"transformer.h.{name[6:]}." for name in shard.layer_names
                  if name.startswith("block.")]
        owned = [n for n in trainable if any(n.startswith(prefix) for prefix in layers)]
        assert shard.owned_param_bytes == sum(nbytes[n] for n in owned)
        assert shard.optimizer_bytes == 2 * shard.owned_param_bytes  # AdamW: two moments
        assert shard.param_bytes > shard.owned_param_bytes
    assert sum(profile.param_bytes.values()) == sum(nbytes[n] for n in trainable)
    assert sum(profile.frozen_param_bytes.values()) == sum(
        v for n, v in nbytes.items() if n not in trainable)
    assert result.peak_device_bytes is not None and result.peak_device_bytes <= budget
    assert device.meter is not None and device.meter.live_bytes == 0


# ---------------------------------------------------------------- planning


def test_a_pilot_pass_holds_the_frozen_base_of_each_shard() -> None:
    spec = lora_spec()
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    plan = make_plan(profile_model(spec, 2), spec.optimizer, [0, 1, 2, 3, 4], device)
    fits = pilot_pass(spec, device, 2)
    for shard in plan.shards:  # the embeddings, wholly frozen, run forward only
        assert fits(shard.start, shard.stop) >= shard.param_bytes + (
            shard.optimizer_bytes + shard.owned_param_bytes if shard.owned_param_bytes else 0)


def test_a_model_whose_full_fine_tuning_spills_fits_as_one_shard_with_lora() -> None:
    lora = lora_spec(model=tiny_config(n_embd=64, n_head=4), eval_data=None, max_steps=2,
                     batch_size=2, peft=LoraSpec(r=2, alpha=4.0))
    full = TrainSpec(**{**lora.__dict__, "peft": None})
    with ShardExecutor("cpu:1x1GiB") as roomy:
        full_bytes, lora_bytes = roomy.plan(full).plain_bytes, roomy.plan(lora).plain_bytes
    for spec, planned in ((full, full_bytes), (lora, lora_bytes)):  # the plan is what it takes
        host = VirtualDevice("cpu:big", budget_bytes=1 << 40)
        assert host.meter is not None
        with host.meter.metering():
            train_plain(spec, host)
        assert abs(planned - host.meter.peak_bytes) <= 0.05 * host.meter.peak_bytes
    profile = profile_model(lora)
    adapter = sum(profile.param_bytes.values())
    base = sum(profile.frozen_param_bytes.values())
    assert 0 < adapter < base // 50
    assert full_bytes - lora_bytes >= 2 * base  # at least the base's two AdamW moments
    budget = (full_bytes + lora_bytes) // 2
    with ShardExecutor(f"cpu:1x{budget}") as executor:
        assert executor.plan(full).spill and not executor.plan(lora).spill
        assert len(executor.plan(lora).shards) == 1
        result = executor.fit(lora)
    assert result.num_promotes == 1  # one shard, resident, within the metered budget
    assert result.peak_device_bytes is not None and result.peak_device_bytes <= budget


def test_sweepmaster_plan_shows_lora_fitting_where_full_fine_tuning_spills(
    tmp_path: Path,
) -> None:
    raw = tiny_sweep(tmp_path, model={"config": {"n_layer": 2, "n_embd": 64, "n_head": 4,
                                                 "n_positions": 32}})
    raw["parameters"] = {}
    path = write_sweep(tmp_path, raw)
    storage = f"sqlite:///{tmp_path / 'plan.db'}"

    def plan(*args: str) -> str:
        result = CliRunner().invoke(app, ["plan", str(path), "--storage", storage, *args],
                                    env={"COLUMNS": "220"})
        assert result.exit_code == 0, result.output
        return result.stdout

    footprints = [plan_sweep(load_sweep_config(path, overrides), storage=storage).jobs[0]
                  .plain_bytes for overrides in ((), ("model.peft.r=4",))]
    budget = f"{sum(footprints) // 2}B"
    full = plan("--devices", f"cpu:1x{budget}")
    lora = plan("--devices", f"cpu:1x{budget}", "--set", "model.peft.r=4")
    assert "   1        1   spills  " in full and "optimizer" in full
    assert "   1        1   plain  " in lora and "optimizer" not in lora  # no shards to show


# ---------------------------------------------------------------- saving


def test_a_sweep_saves_each_adapter_in_peft_format_loadable_to_the_same_eval_loss(
    tmp_path: Path,
) -> None:
    raw = tiny_sweep(tmp_path, model={**tiny_sweep(tmp_path)["model"],
                                      "peft": {"r": 2, "alpha": 8, "dropout": 0.05}},
                     output={"dir": str(tmp_path / "checkpoints"), "save": "all"})
    raw["parameters"] = {"model.peft.r": {"values": [2, 4]}}
    config = parse_sweep_config(raw)
    outcome = run_sweep(config)
    assert outcome.num_failed == 0
    for trial, folder, saved, loss in reload_saved_adapters(raw, config):
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json",
                                                            "adapter_model.safetensors"]
        assert (saved["r"], saved["lora_alpha"], saved["lora_dropout"]) == (
            trial.params["model.peft.r"], 8, 0.05)
        assert loss == pytest.approx(trial.value, rel=1e-6)


def reload_saved_adapters(
    raw: dict[str, Any], config: SweepConfig
) -> list[tuple[optuna.trial.FrozenTrial, Path, dict[str, Any], float]]:
    """Each trial of a finished LoRA sweep, its adapter folder, the saved adapter config, and
    the eval loss of ``PeftModel.from_pretrained`` over the base the trial trained."""
    study = optuna.load_study(study_name="tiny", storage=raw["storage"])
    data = prepare_data(config)
    hf_config = model_config_from_mapping(raw["model"]["config"], vocab_size=data.vocab_size)
    assert data.valid is not None
    reloaded = []
    for trial in study.trials:
        folder = Path(trial.user_attrs["checkpoint_path"])
        saved = json.loads((folder / "adapter_config.json").read_text())
        torch.manual_seed(raw["train"]["seed"])  # the base the trial trained over
        base = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config))
        model = PeftModel.from_pretrained(base, folder)
        loss = evaluate_loss(model, data.valid, raw["train"]["batch_size"], Device("cpu"))
        reloaded.append((trial, folder, saved, loss))
    return reloaded


# ---------------------------------------------------------------- configuration


def test_every_lora_field_is_sweepable_by_its_dotted_path(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path)
    raw["parameters"] = {
        "model.peft.r": {"values": [4, 8]}, "model.peft.alpha": {"values": [8, 32]},
        "model.peft.dropout": {"values": [0.0, 0.1]},
        "model.peft.target_modules": {"value": ["c_attn", "c_fc"]}}
    with pytest.raises(ConfigError, match=r"parameters\.model\.peft\.r: model\.peft to be set"):
        parse_sweep_config(raw)  # without model.peft the parameters would mean nothing
    raw["model"]["peft"] = {"type": "lora"}
    config = parse_sweep_config(raw)
    assert config.model.peft is not None and config.grid_size() == 8
    trial = config.with_params({"model.peft.r": 16, "model.peft.alpha": 32,
                                "model.peft.dropout": 0.1})
    assert trial.model.peft is not None
    assert trial.model.peft.lora_spec() == LoraSpec(r=16, alpha=32.0, dropout=0.1,
                                                    target_modules=("c_attn", "c_fc"))


def test_sets_of_target_modules_are_swept_as_comma_separated_names(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path)
    raw["model"]["peft"] = {"r": 4}
    raw["parameters"] = {"model.peft.target_modules": {"values": ["c_attn", "c_attn, c_fc"]}}
    path = write_sweep(tmp_path, raw)
    config = load_sweep_config(path)
    assert config.grid_size() == 2
    trial = config.with_params({"model.peft.target_modules": "c_attn, c_fc"})
    assert trial.model.peft is not None
    assert trial.model.peft.lora_spec().target_modules == ("c_attn", "c_fc")
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert "grid of 2 configurations" in result.stdout


@pytest.mark.parametrize("kwargs, message", [
    ({"r": 0}, "r must be an integer >= 1, got 0"),
    ({"alpha": 0.0}, "alpha must be a finite number > 0, got 0.0"),
    ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0"),
    ({"target_modules": ()}, "target_modules must be a non-empty sequence"),
])
def test_lora_spec_refuses_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoraSpec(**kwargs)


def test_target_modules_matching_nothing_name_the_linear_layers() -> None:
    with pytest.raises(ValueError, match=r"LoRA target_modules \['q_proj'\] match no module of "
                       r"GPT2LMHeadModel; expected names among its linear layers: c_attn, c_fc, "
                       "c_proj, lm_head"):
        build_model(tiny_config(), peft=LoraSpec(target_modules=("q_proj",)))
