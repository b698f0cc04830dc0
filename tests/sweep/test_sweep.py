import json
import math
import shutil
import subprocess

import optuna
import pytest
import torch
from optuna.trial import TrialState
from sqlalchemy import func, select

from sweepmaster import study as study_manager
from sweepmaster.config import load_sweep_config
from sweepmaster.store import create_store_engine, get_sweep, metric_history, trial_progress
from sweepmaster.store.models import Metric as MetricRecord
from sweepmaster.sweep import SweepObserver, run_sweep
from sweepmaster.sweep.resume import sweep_output_dir
from tests.kit.sweeps import tiny_sweep, write_sweep


def _launch(tmp_path, **sections):
    path = write_sweep(tmp_path, tiny_sweep(tmp_path, **sections))
    config = load_sweep_config(path)
    return config, run_sweep(config)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The default tiny sweep launched once, for the tests that only read it: its directory,
    config and outcome. A test that relaunches it must launch its own."""
    tmp_path = tmp_path_factory.mktemp("launched")
    config, outcome = _launch(tmp_path)
    return tmp_path, config, outcome


def test_launch_runs_every_grid_cell_and_records_progress(launched):
    tmp_path, config, outcome = launched
    assert outcome.num_run == 4 and outcome.num_finished == 4 and outcome.num_failed == 0

    study = optuna.load_study(study_name="tiny", storage=config.storage)
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    grid = {(t.params["train.lr"], t.params["train.batch_size"]) for t in trials}
    assert grid == {(1e-2, 2), (1e-2, 4), (3e-3, 2), (3e-3, 4)}
    # intermediate values at every evaluation after step 0
    assert all(sorted(t.intermediate_values) == [3, 6] for t in trials)

    engine = create_store_engine(config.storage)
    sweep = get_sweep(engine, "tiny")
    assert sweep is not None and sweep.status == "completed"
    rows = {r.trial_number: r for r in trial_progress(engine, sweep.id)}
    assert sorted(rows) == [0, 1, 2, 3]
    for t in trials:
        row = rows[t.number]
        assert row.state == "COMPLETE"
        assert (row.step, row.total_steps) == (6, 6)
        assert row.objective == pytest.approx(t.value)
        assert row.eval_loss == pytest.approx(t.value)
        history = metric_history(engine, sweep.id, t.number)
        train = [(s, v) for s, n, v in history if n == "train_loss"]
        evals = [(s, v) for s, n, v in history if n == "eval_loss"]
        assert [s for s, _ in train] == [1, 2, 3, 4, 5, 6]
        assert [s for s, _ in evals] == [0, 3, 6]
        assert evals[-1][1] < evals[0][1]  # the validation loss falls
    best = study.best_trial
    (sweep_dir,) = (tmp_path / "checkpoints").iterdir()  # the sweep's own directory
    assert sweep_dir == sweep_output_dir(config, sweep)
    assert rows[best.number].checkpoint_path == str(sweep_dir / f"trial-{best.number}")
    assert [p.name for p in sweep_dir.iterdir()] == [f"trial-{best.number}"]  # save: best
    assert [n for n, r in rows.items() if r.checkpoint_path] == [best.number]
    assert not any("checkpoint_path" in t.user_attrs for t in trials)  # they cannot be cleared


def test_relaunch_adds_nothing(tmp_path):
    config, _ = _launch(tmp_path)
    outcome = run_sweep(config)
    assert outcome.num_run == 0
    study = optuna.load_study(study_name="tiny", storage=config.storage)
    assert len(study.trials) == 4
    engine = create_store_engine(config.storage)
    with engine.connect() as conn:
        num_metrics = conn.execute(select(func.count()).select_from(MetricRecord)).scalar_one()
    run_sweep(config)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(MetricRecord)).scalar_one() == (
            num_metrics)


def test_n_trials_extends_a_tpe_sweep(tmp_path):
    config, outcome = _launch(
        tmp_path, study={"sampler": "random", "n_trials": 2},
        parameters={"train.lr": {"min": 1e-3, "max": 1e-2, "distribution": "log_uniform_values"}})
    assert outcome.num_finished == 2
    outcome = run_sweep(config, n_trials=3)
    assert (outcome.num_run, outcome.num_finished) == (1, 3)


def test_pruned_trial_ends_pruned(tmp_path):
    raw = tiny_sweep(
        tmp_path,
        study={"sampler": "random", "n_trials": 2,
               "pruner": {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0}},
        parameters={"train.lr": {"values": [1e-2, 1e-9]}},
    )
    config = load_sweep_config(write_sweep(tmp_path, raw))
    study, _ = study_manager.open_study(config, config.storage)
    study.enqueue_trial({"train.lr": 1e-2})
    study.enqueue_trial({"train.lr": 1e-9})  # learns nothing: worse than the median at step 3
    run_sweep(config)
    trials = optuna.load_study(study_name="tiny", storage=config.storage).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.PRUNED]
    engine = create_store_engine(config.storage)
    sweep = get_sweep(engine, "tiny")
    rows = {r.trial_number: r for r in trial_progress(engine, sweep.id)}
    assert rows[1].state == "PRUNED" and rows[1].step == 3


class _InterruptAt(SweepObserver):
    def __init__(self, trial_number, step):
        self.trial_number, self.step = trial_number, step

    def trial_step(self, number, event):
        if number == self.trial_number and event.step == self.step:
            raise KeyboardInterrupt


def test_ctrl_c_marks_the_trial_failed_and_relaunch_finishes_the_grid(tmp_path):
    path = write_sweep(tmp_path, tiny_sweep(tmp_path))
    config = load_sweep_config(path)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(config, observer=_InterruptAt(trial_number=1, step=2))
    study = optuna.load_study(study_name="tiny", storage=config.storage)
    states = [t.state for t in study.get_trials()]
    assert states == [TrialState.COMPLETE, TrialState.FAIL]
    failed = study.trials[1]
    assert "interrupted" in failed.system_attrs[study_manager.FAIL_REASON_ATTR]
    engine = create_store_engine(config.storage)
    sweep = get_sweep(engine, "tiny")
    assert sweep.status == "interrupted"
    row = {r.trial_number: r for r in trial_progress(engine, sweep.id)}[1]
    assert row.state == "FAIL" and "interrupted" in row.failure_reason

    outcome = run_sweep(config)
    trials = optuna.load_study(study_name="tiny", storage=config.storage).get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 4 and outcome.num_run == 3
    params = {(t.params["train.lr"], t.params["train.batch_size"]) for t in complete}
    assert len(params) == 4  # the interrupted cell ran again, no cell twice
    assert failed.params in [t.params for t in complete]


def test_a_failing_trial_fails_alone(tmp_path):
    config, outcome = _launch(tmp_path, parameters={"train.lr": {"values": [1e-2, 1e30]}})
    trials = optuna.load_study(study_name="tiny", storage=config.storage).get_trials()
    states = {(t.params["train.lr"], t.params["train.batch_size"]): t.state for t in trials}
    assert states == {(1e-2, 2): TrialState.COMPLETE, (1e-2, 4): TrialState.COMPLETE,
                      (1e30, 2): TrialState.FAIL, (1e30, 4): TrialState.FAIL}
    assert outcome.num_failed == 2 and outcome.num_finished == 2
    for t in trials:
        if t.state == TrialState.FAIL:
            assert "FloatingPointError" in t.system_attrs[study_manager.FAIL_REASON_ATTR]


def test_optuna_cli_reads_the_study(launched):
    _, config, _ = launched
    out = subprocess.run(
        [shutil.which("optuna") or "optuna", "trials", "--study-name", "tiny", "--storage",
         config.storage, "-f", "json"],
        capture_output=True, text=True, check=True,
    ).stdout
    trials = json.loads(out)
    assert len(trials) == 4
    assert {t["state"] for t in trials} == {"COMPLETE"}
    assert all(math.isfinite(t["value"]) for t in trials)


def test_relaunch_with_a_different_config_is_refused_and_writes_nothing(launched, tmp_path):
    from sweepmaster.errors import StorageError

    launched_dir, config, _ = launched  # refused: the shared sweep stays as it was
    changed = load_sweep_config(write_sweep(
        tmp_path, tiny_sweep(launched_dir, train={"max_steps": 7}), "changed.yaml"))
    with pytest.raises(StorageError, match="tiny.*different configuration"):
        run_sweep(changed)
    assert len(optuna.load_study(study_name="tiny", storage=config.storage).trials) == 4


def test_spilled_trials_share_two_virtual_devices(tmp_path):
    """Trials larger than a device train task by task on an executor of two devices.

    Which device runs which task is decided by when the worker threads free up, so the test
    asserts completion, accounting and exactness, never the interleaving.
    """
    from transformers import AutoModelForCausalLM

    from sweepmaster.config.train_specs import prepare_data, train_spec_from_config
    from sweepmaster.runtime import Device, ShardExecutor, train_plain
    from sweepmaster.store.models import TaskEvent

    config, outcome = _launch(tmp_path, resources={"devices": "cpu:2x48MiB"})
    assert outcome.num_finished == 4 and outcome.num_failed == 0
    study = optuna.load_study(study_name="tiny", storage=config.storage)
    engine = create_store_engine(config.storage)
    sweep = get_sweep(engine, "tiny")
    rows = {r.trial_number: r for r in trial_progress(engine, sweep.id)}
    with engine.connect() as connection:
        events = connection.execute(select(TaskEvent).where(TaskEvent.sweep_id == sweep.id)).all()
    assert {e.device for e in events} <= {"cpu:0", "cpu:1"}
    assert {e.trial_number for e in events} == {0, 1, 2, 3}
    for t in study.get_trials():
        row = rows[t.number]
        assert row.state == "COMPLETE" and row.swap_bytes > 0 and row.num_promotes > 0
        assert row.peak_device_bytes <= 48 * 2**20
        swapped = sum(e.bytes for e in events if e.trial_number == t.number)
        assert swapped == row.swap_bytes  # the timeline accounts for every byte moved

    # the best trial's saved weights are those of plain training of the same configuration
    best = study.best_trial
    trial_config = config.with_params(best.params)
    spec = train_spec_from_config(trial_config, prepare_data(trial_config))
    executor = ShardExecutor("cpu:2x48MiB")
    assert executor.will_spill(spec) and executor.plan(spec).plain_bytes > 48 * 2**20
    assert rows[best.number].num_shards == len(executor.plan(spec).shards)
    # the swap / recompute plan of the spilled jobs is kept beside their partition
    from sweepmaster.runtime import MemoryPlan
    from sweepmaster.store.models import Partition

    with engine.connect() as connection:
        kept = connection.execute(select(Partition.memory_plan_json)).scalars().all()
    assert kept and all(MemoryPlan.from_json(text).budget_bytes == 48 * 2**20 for text in kept)
    expected = train_plain(spec, Device("cpu")).state_dict
    saved = AutoModelForCausalLM.from_pretrained(rows[best.number].checkpoint_path).state_dict()
    for name, tensor in expected.items():
        assert torch.allclose(saved[name], tensor, rtol=0, atol=1e-4), name


def test_saving_a_checkpoint_leaves_the_global_random_streams_alone(tmp_path):
    """Trials on the CPU draw dropout from its generator while another trial's weights save."""
    import dataclasses

    from sweepmaster.config.train_specs import prepare_data, train_spec_from_config
    from sweepmaster.runtime import Device, train_plain
    from sweepmaster.sweep.kept_weights import FinalWeightsKeeper as CheckpointKeeper

    config = load_sweep_config(write_sweep(tmp_path, tiny_sweep(tmp_path, output={
        "dir": str(tmp_path / "checkpoints"), "save": "all"})))
    trial_config = config.with_params({"train.lr": 1e-2, "train.batch_size": 2})
    spec = dataclasses.replace(train_spec_from_config(trial_config, prepare_data(trial_config)),
                               max_steps=1, eval_data=None)
    result = train_plain(spec, Device("cpu"))
    keeper = CheckpointKeeper(config, optuna.create_study(), tmp_path / "checkpoints" / "tiny-0",
                              lambda numbers: None)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    path = keeper.save(0, spec, result)
    assert path is not None and path.is_dir()
    assert torch.equal(torch.get_rng_state(), before)


def test_a_grid_of_spilled_and_fitting_trials_sizes_each_by_its_own_plan(tmp_path):
    """Each trial's share of the device comes from its own plan: each gets half, two run at once.

    Batch 1 fits the device with room for another (37 of 80 MiB), batch 8 spills; the grid's
    first trial fits. Sized by that first trial alone, the launch ran one job at a time.
    """
    from sweepmaster.config.train_specs import prepare_data, train_spec_from_config
    from sweepmaster.runtime import ShardExecutor
    from sweepmaster.store.models import TaskEvent
    from sweepmaster.sweep.launch import device_share, max_concurrent_trials

    devices = "cpu:1x80MiB"
    config, outcome = _launch(tmp_path, resources={"devices": devices},
                              parameters={"train.batch_size": {"values": [8, 1]},
                                          "train.lr": {"values": [1e-2, 3e-3]}})
    assert outcome.num_finished == 4 and outcome.num_failed == 0
    study = optuna.load_study(study_name="tiny", storage=config.storage)
    trials = sorted(study.get_trials(), key=lambda t: t.number)
    executor = ShardExecutor(devices)
    shares = {}
    for t in trials:
        trial_config = config.with_params(t.params)
        spec = train_spec_from_config(trial_config, prepare_data(trial_config))
        assert executor.will_spill(spec) == (t.params["train.batch_size"] == 8)
        shares[t.number] = device_share(executor, spec)
        # two at once on the one device: which two, and how their tasks interleave, is the
        # threads' timing; that two kept jobs stay resident beside each other is the executor's
        # (tests/runtime/scheduling/test_residency.py)
        assert max_concurrent_trials(executor, spec) == 2
    fitting = [t.number for t in trials if t.params["train.batch_size"] == 1]
    spilled = [t.number for t in trials if t.params["train.batch_size"] == 8]
    assert trials[0].number in fitting  # the trial a single capacity was sized from
    assert all(shares[n] == 0.5 for n in fitting + spilled)

    engine = create_store_engine(config.storage)
    sweep = get_sweep(engine, "tiny")
    with engine.connect() as connection:
        events = connection.execute(select(TaskEvent).where(TaskEvent.sweep_id == sweep.id)).all()
    assert {e.device for e in events} == {"cpu:0"}
    assert {e.trial_number for e in events} == {t.number for t in trials}
    for number in spilled:  # a spilled trial moves its shard around every step
        assert all(e.bytes > 0 for e in events if e.trial_number == number
                   and e.kind == "backward")
