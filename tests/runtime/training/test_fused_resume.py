"""Fused arrays checkpoint and resume per member: a crash costs no finished step.

A fused array that fits its device (one stacked shard, as the executor trains it) of three tiny
GPT-2 members (dropout on, AdamW, different learning rates and checkpoint cadences) is
interrupted mid-run and trained again from its members' checkpoints:
each member resumes from its own last step (they differ), repeats no step, evaluation or event,
and ends with the weights of the uninterrupted run. A fused member's checkpoint is an unfused
trial's: ``train_plain`` resumes it too.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config

from sweepmaster.runtime import Device
from sweepmaster.runtime.training.plain import train_plain
from sweepmaster.runtime.training.training_state import checkpoint_files, job_key, load_latest
from sweepmaster.workload import OptimizerSpec, TrainSpec
from sweepmaster.workload.spec import TrainResult
from tests.kit.callbacks import StopAfterStep
from tests.kit.fused import train_array

CPU = Device("cpu")
LRS = (3e-3, 1e-3, 5e-3)
EVERY = (4, 3, 5)  # checkpoint cadences: a crash after step 7 leaves steps 4, 6 and 5


def make_specs(state_root: Path | None = None) -> list[TrainSpec]:
    """Three members of a 2-layer GPT-2 (dropout 0.1): 10 steps, evaluated every 4."""
    generator = torch.Generator().manual_seed(123)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=101,
                        bos_token_id=0, eos_token_id=0)
    train = torch.randint(0, 101, (26, 16), generator=generator)
    evals = torch.randint(0, 101, (5, 16), generator=generator)
    return [
        TrainSpec(
            config, train, eval_data=evals, batch_size=4, max_steps=10, eval_every=4,
            seed=7 + k, name=f"m{k}",
            optimizer=OptimizerSpec(name="adamw", lr=lr, weight_decay=0.1, warmup_steps=2,
                                    schedule="cosine", grad_clip=0.5),
            state_dir=None if state_root is None else state_root / f"m{k}",
            checkpoint_every=None if state_root is None else EVERY[k],
        )
        for k, lr in enumerate(LRS)
    ]


class Interrupt(BaseException):
    """Ends the whole array, as Ctrl-C or a killed worker does (an ``Exception`` fails one)."""


#: Records a member's events; raises :class:`Interrupt` after step ``stop``.
Record = functools.partial(StopAfterStep, error=Interrupt)


@pytest.fixture(scope="module")
def reference() -> list[TrainResult]:
    """The array trained without interruption or checkpoints."""
    return train_array(make_specs())


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_an_interrupted_fused_array_resumes_each_member_exactly(
    tmp_path: Path, reference: list[TrainResult]
) -> None:
    specs = make_specs(tmp_path)
    first = [Record(stop=7), Record(), Record()]
    with pytest.raises(Interrupt):
        train_array(specs, first)
    done = [4, 6, 5]  # each member's last checkpoint before the crash
    for spec, step in zip(specs, done, strict=True):
        assert spec.state_dir is not None
        assert int(checkpoint_files(spec.state_dir)[0].name[5:14]) == step

    torch.manual_seed(999)  # the process's generator moved on meanwhile
    second = [Record(), Record(), Record()]
    resumed = train_array(specs, second)

    for k, (got, want) in enumerate(zip(resumed, reference, strict=True)):
        diff = max_abs_diff(got.state_dict, want.state_dict)
        print(f"member {k}: resumed from step {done[k]}, max abs weight diff {diff:.3g}")
        for name, tensor in want.state_dict.items():
            torch.testing.assert_close(got.state_dict[name], tensor, rtol=1e-6, atol=1e-6,
                                       msg=name)
        assert got.steps == 10
        assert [(p.step, p.name) for p in got.metrics] == \
            [(p.step, p.name) for p in want.metrics]
        for metric in ("train_loss", "lr", "eval_loss"):
            assert got.history(metric) == pytest.approx(want.history(metric), rel=1e-6)
        assert second[k].starts[0].resumed_from_step == done[k]
        assert second[k].steps == list(range(done[k] + 1, 11))  # no finished step redone
        assert second[k].evals == [s for s in (4, 8, 10) if s > done[k]]
    assert first[0].evals == [0, 4]


def test_a_fused_member_checkpoint_resumes_unfused(
    tmp_path: Path, reference: list[TrainResult]
) -> None:
    specs = make_specs(tmp_path)
    with pytest.raises(Interrupt):
        train_array(specs, [Record(stop=7), Record(), Record()])
    spec = specs[1]
    state = load_latest(spec.state_dir, job_key(spec), "cpu")
    assert state is not None and state.step == 6
    assert set(state.optimizer[next(iter(state.optimizer))]) == {"step", "exp_avg", "exp_avg_sq"}

    again = Record()
    result = train_plain(spec, CPU, again)

    assert again.starts[0].resumed_from_step == 6 and again.steps == [7, 8, 9, 10]
    # Fused AdamW equals plain AdamW up to float rounding that Adam amplifies (lr-scaled).
    diff = max_abs_diff(result.state_dict, reference[1].state_dict)
    print(f"member 1 resumed unfused: max abs weight diff {diff:.3g}")
    assert diff <= 1e-2 * spec.optimizer.lr


def test_a_member_resumed_in_another_array_equals_its_uninterrupted_run(
    tmp_path: Path, reference: list[TrainResult]
) -> None:
    specs = make_specs(tmp_path)
    with pytest.raises(Interrupt):
        train_array(specs, [Record(stop=7), Record(), Record()])
    # Member 2 (checkpointed at step 5) joins a fresh array with a new member at step 0.
    fresh = dataclasses.replace(make_specs()[0], seed=40, name="new")
    result = train_array([fresh, specs[2]])[1]
    diff = max_abs_diff(result.state_dict, reference[2].state_dict)
    print(f"member 2 resumed beside a new member: max abs weight diff {diff:.3g}")
    assert diff <= 1e-2 * specs[2].optimizer.lr
