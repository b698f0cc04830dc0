"""The Python API: sweepmaster.Executor inside Optuna objectives."""

from __future__ import annotations

import optuna
import pytest
import torch
from optuna.trial import TrialState
from transformers import GPT2Config

import sweepmaster

VOCAB = 101


def tiny_spec(lr: float, name: str = "job", max_steps: int = 6) -> sweepmaster.TrainSpec:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, VOCAB, (64, 16), generator=gen)
    return sweepmaster.TrainSpec(
        model=GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=VOCAB),
        train_data=blocks[:48], eval_data=blocks[48:],
        optimizer=sweepmaster.OptimizerSpec(name="adamw", lr=lr),
        batch_size=4, max_steps=max_steps, eval_every=2, seed=0, name=name,
    )


def test_fit_reports_intermediate_values_to_the_trial():
    executor = sweepmaster.Executor(devices="cpu")
    study = optuna.create_study()
    study.optimize(lambda t: executor.fit(tiny_spec(t.suggest_float("lr", 1e-3, 1e-2)), t)
                   .objective, n_trials=2)
    for trial in study.trials:
        assert trial.state == TrialState.COMPLETE
        assert sorted(trial.intermediate_values) == [2, 4, 6]
        assert trial.intermediate_values[6] == pytest.approx(trial.value)


def test_pruner_raises_trial_pruned_and_stops_training():
    executor = sweepmaster.Executor(devices="cpu")
    steps_seen = []

    class Count(sweepmaster.TrainCallbacks):
        def on_step(self, event):
            steps_seen.append(event.step)

    # ThresholdPruner(upper=0) prunes at the first reported loss (every loss is > 0)
    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=0.0))
    study.optimize(lambda t: executor.fit(tiny_spec(1e-3), t, callbacks=Count()).objective,
                   n_trials=1)
    (trial,) = study.trials
    assert trial.state == TrialState.PRUNED
    assert list(trial.intermediate_values) == [2]
    assert steps_seen == [1, 2]


def test_concurrent_objectives_share_the_executor_and_match_sequential_results():
    executor = sweepmaster.Executor(devices="cpu")
    lrs = [1e-3, 3e-3, 1e-2]
    sequential = {lr: executor.fit(tiny_spec(lr)).objective for lr in lrs}

    study = optuna.create_study()
    for lr in lrs:
        study.enqueue_trial({"lr": lr})
    study.optimize(lambda t: executor.fit(tiny_spec(t.suggest_float("lr", 1e-3, 1e-2)), t)
                   .objective, n_trials=3, n_jobs=3)
    assert all(t.state == TrialState.COMPLETE for t in study.trials)
    for t in study.trials:
        assert t.value == pytest.approx(sequential[t.params["lr"]], abs=0, rel=1e-12)


def test_submit_fused_reports_each_member_to_its_own_trial():
    executor = sweepmaster.Executor(devices="cpu")
    alone = {lr: executor.fit(tiny_spec(lr)) for lr in (1e-2, 1e-9)}
    # at step 2, lr 1e-2 has eval loss 4.653 (pruned) and lr 1e-9 still 4.618 (kept)
    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=4.63))
    trials = [study.ask(), study.ask()]
    specs = [tiny_spec(1e-2, "a"), tiny_spec(1e-9, "b")]
    futures = executor.submit_fused(specs, trials=trials)
    for trial, future in zip(trials, futures, strict=True):
        result = future.result()
        if result.pruned:
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, result.objective)
    pruned, complete = study.trials
    assert pruned.state == TrialState.PRUNED and list(pruned.intermediate_values) == [2]
    assert pruned.intermediate_values[2] == pytest.approx(alone[1e-2].history("eval_loss")[1][1])
    assert complete.state == TrialState.COMPLETE and sorted(complete.intermediate_values) == [
        2, 4, 6]
    assert complete.value == pytest.approx(alone[1e-9].objective, rel=1e-6)
    with pytest.raises(ValueError, match="2 specs but 1 trials"):
        executor.submit_fused(specs, trials=trials[:1])
