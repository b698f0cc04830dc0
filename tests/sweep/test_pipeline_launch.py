"""`sweepmaster launch` with resources.pipeline: fewer jobs than devices, pipelined over both.

A smaller copy of examples/pipeline-cpu.yaml: one spilled trial on two virtual devices. With one
job and two free devices at every step boundary, Sharded-LRTF pipelines each of its steps
whatever the worker threads' timing (the example's three trials pipeline only their tail, and
when the tail starts depends on the measured durations, so the launch test holds one job).
"""

from __future__ import annotations

from pathlib import Path

import optuna
import torch
import yaml
from sqlalchemy import select
from typer.testing import CliRunner

from sweepmaster.cli import app
from sweepmaster.config import load_sweep_config
from sweepmaster.store import create_store_engine, get_sweep, trial_progress
from sweepmaster.store.models import TaskEvent
from tests.kit.sweeps import EXAMPLES, tiny_sweep, write_sweep

BUDGET = 160 * 2**20  # plain training needs 173 MiB: two shards, one per device pipelined


def _pipeline_sweep(tmp_path: Path) -> Path:
    raw = tiny_sweep(tmp_path, name="pipe", train={"eval_every": None},
                     resources={"devices": f"cpu:2x{BUDGET // 2**20}MiB", "pipeline": "auto"},
                     output={"dir": str(tmp_path / "checkpoints"), "save": "all"})
    # blocks large enough beside GPT-2's tied 50,257-token embedding that the model needs two
    # shards (a smaller one trains as one shard in microbatches, and never pipelines)
    raw["model"]["config"].update(n_layer=6, n_embd=128)
    raw["parameters"] = {"train.max_steps": {"values": [4]}}
    return write_sweep(tmp_path, raw)


def _assert_plain(name: str, actual: torch.Tensor, expected: torch.Tensor,
                  key_bias_atol: float) -> None:
    """Equal within 1e-4 (test_sweep.py's launch tolerance), the attention's key bias aside.

    AdamW divides a gradient by its root mean square plus 1e-8, so where a gradient is near
    float noise, summing microbatches in another order moves the update: over steps of lr 1e-2
    the tied embedding's rows of tokens the batches never hold (gradients from the head only)
    differ from plain training by up to 2e-5 in one element of 6.4 million, the rest by less
    than 1e-5. The key bias has no gradient at all in exact arithmetic (softmax ignores a shift
    of a query's scores): what it gets is noise that AdamW scales to updates of up to ``lr``,
    so it is held to ``lr`` per step.
    """
    if name.endswith("attn.c_attn.bias"):  # query, key, value thirds
        q, k, v = actual.chunk(3)
        q_plain, k_plain, v_plain = expected.chunk(3)
        torch.testing.assert_close(k, k_plain, rtol=0, atol=key_bias_atol, msg=name)
        actual, expected = torch.cat([q, v]), torch.cat([q_plain, v_plain])
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4, msg=name)


def test_the_example_turns_pipelining_on_for_a_tail_of_one_job() -> None:
    raw = yaml.safe_load((EXAMPLES / "pipeline-cpu.yaml").read_text())
    assert raw["resources"]["pipeline"] == "auto" and raw["train"]["eval_every"] is None
    assert raw["resources"]["devices"] == "cpu:2x256MiB"
    steps = raw["parameters"]["train.max_steps"]["values"]
    assert len(steps) == 3 and max(steps) > sum(steps) - max(steps)  # a tail of one job


def test_launch_pipelines_a_lone_job_plain_with_p2p_bytes_apart(tmp_path):
    from transformers import AutoModelForCausalLM

    from sweepmaster.config.train_specs import prepare_data, train_spec_from_config
    from sweepmaster.runtime import Device, ShardExecutor, train_plain
    from sweepmaster.sweep.plan import pipeline_shape

    path = _pipeline_sweep(tmp_path)
    config = load_sweep_config(path)
    runner = CliRunner()
    result = runner.invoke(app, ["launch", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output

    study = optuna.load_study(study_name="pipe", storage=config.storage)
    engine = create_store_engine(config.storage)
    sweep = get_sweep(engine, "pipe")
    rows = {r.trial_number: r for r in trial_progress(engine, sweep.id)}
    with engine.connect() as connection:
        events = connection.execute(select(TaskEvent).where(TaskEvent.sweep_id == sweep.id)).all()
    trials = study.get_trials()
    assert len(trials) == 1 and all(t.state.name == "COMPLETE" for t in trials)
    [lone] = trials

    # the trial's pipelined steps: a record on each device, p2p bytes apart from swap
    pipelined = [e for e in events if e.kind == "pipeline" and e.trial_number == lone.number]
    assert {e.device for e in pipelined} == {"cpu:0", "cpu:1"}
    for t in trials:
        row = rows[t.number]
        assert row.state == "COMPLETE" and row.num_replans == 0
        assert row.swap_bytes > 0 and row.peak_device_bytes <= BUDGET
        mine = [e for e in events if e.trial_number == t.number]
        assert sum(e.bytes for e in mine) == row.swap_bytes  # host <-> device, every byte
        assert sum(e.p2p_bytes for e in mine) == row.p2p_bytes  # device -> device, apart
    assert rows[lone.number].p2p_bytes > 0
    assert all(e.p2p_bytes == 0 for e in events if e.kind != "pipeline")

    # every trial ends with plain training's weights (a pipelined step sums microbatches)
    data = prepare_data(config)
    for t in trials:
        trial_config = config.with_params(t.params)
        spec = train_spec_from_config(trial_config, data)
        if t is lone:
            plan = ShardExecutor(config.resources.devices).plan(spec)
            assert plan.spill and pipeline_shape(plan, 2).packs
        expected = train_plain(spec, Device("cpu")).state_dict
        saved = AutoModelForCausalLM.from_pretrained(rows[t.number].checkpoint_path).state_dict()
        for name, tensor in expected.items():
            _assert_plain(name, saved[name], tensor, trial_config.train.lr * t.params[
                "train.max_steps"])

    status = runner.invoke(app, ["status", "--storage", config.storage, "--sweep", "pipe"],
                           env={"COLUMNS": "200"})
    assert status.exit_code == 0, status.output
    header = next(line for line in status.stdout.splitlines() if "state" in line)
    assert header.split()[-5:] == ["shards", "swap", "p2p", "promotes", "demotes"]
