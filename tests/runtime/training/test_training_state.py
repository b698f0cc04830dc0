"""Crash-safe training checkpoints: a job stopped anywhere resumes to the same weights.

Every resumed run is compared with an uninterrupted one by ``torch.equal`` on every weight
(CPU, fp32, dropout on, evaluation in between, warmup + decay schedules, AdamW and SGD): the
crash is a callback raising mid-run, and a subprocess killed with SIGKILL while it trains.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config

from sweepmaster.runtime import Device, train_plain
from sweepmaster.runtime.training.plain import build_optimizer, minibatch_indices
from sweepmaster.runtime.training.training_state import (
    CHECKPOINT_VERSION,
    TrainingState,
    checkpoint_files,
    job_key,
    load_latest,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    save_checkpoint,
)
from sweepmaster.workload import OptimizerSpec, TrainSpec
from tests.kit.callbacks import StopAfterStep
from tests.kit.data import ROOT

CPU = Device("cpu")
LOG = "sweepmaster.runtime.training.training_state"

OPTIMIZERS = {
    "adamw": OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1, betas=(0.8, 0.95),
                           warmup_steps=2, schedule="cosine", grad_clip=0.5),
    "sgd": OptimizerSpec(name="sgd", lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True,
                         warmup_steps=3, schedule="linear"),
}


def make_spec(optimizer: str = "adamw", state_dir: Path | None = None,
              checkpoint_every: int | None = None, **overrides) -> TrainSpec:
    """A 2-layer GPT-2 with dropout 0.1: 12 steps over 2 epochs of 6, evaluated every 5."""
    generator = torch.Generator().manual_seed(123)
    kwargs = {
        "model": GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=101,
                            bos_token_id=0, eos_token_id=0),
        "train_data": torch.randint(0, 101, (26, 16), generator=generator),
        "eval_data": torch.randint(0, 101, (5, 16), generator=generator),
        "optimizer": OPTIMIZERS[optimizer], "batch_size": 4, "max_steps": 12, "eval_every": 5,
        "seed": 7, "state_dir": state_dir, "checkpoint_every": checkpoint_every,
    }
    kwargs.update(overrides)
    return TrainSpec(**kwargs)


class Crash(Exception):
    pass


#: Raises :class:`Crash` after optimizer step ``stop`` (before its evaluation and checkpoint).
CrashAt = functools.partial(StopAfterStep, error=Crash)


def assert_same_run(resumed, reference, exact: bool = True) -> None:
    assert resumed.state_dict.keys() == reference.state_dict.keys()
    for name, tensor in reference.state_dict.items():
        if exact:
            assert torch.equal(resumed.state_dict[name], tensor), name
        else:
            torch.testing.assert_close(resumed.state_dict[name], tensor, msg=name)
    for metric in ("train_loss", "lr", "eval_loss", "eval_perplexity"):
        if exact:
            assert resumed.history(metric) == reference.history(metric), metric
        else:
            assert resumed.history(metric) == pytest.approx(reference.history(metric)), metric
    assert [(p.step, p.name) for p in resumed.metrics] == \
        [(p.step, p.name) for p in reference.metrics]
    assert resumed.steps == reference.steps
    assert resumed.objective == (reference.objective if exact
                                 else pytest.approx(reference.objective))


@pytest.fixture(scope="module")
def references() -> dict[str, object]:
    """Uninterrupted runs without any checkpointing."""
    return {name: train_plain(make_spec(name), CPU) for name in OPTIMIZERS}


@pytest.mark.parametrize(("optimizer", "crash_step"), [("adamw", 7), ("adamw", 10),
                                                      ("sgd", 8)])
def test_resume_after_a_crash_equals_an_uninterrupted_run(
    optimizer: str, crash_step: int, tmp_path: Path, references: dict
) -> None:
    spec = make_spec(optimizer, tmp_path / "state", checkpoint_every=3)
    first = CrashAt(crash_step)
    with pytest.raises(Crash):
        train_plain(spec, CPU, first)
    done = 3 * ((crash_step - 1) // 3)  # the last checkpoint before the crash
    assert [int(p.name[5:14]) for p in checkpoint_files(spec.state_dir)] == [done, done - 3]

    torch.manual_seed(999)  # the process's generator moved on meanwhile
    second = CrashAt()
    resumed = train_plain(spec, CPU, second)

    assert_same_run(resumed, references[optimizer])
    assert second.starts[0].resumed_from_step == done
    assert second.steps == list(range(done + 1, 13))
    assert second.evals == [s for s in (5, 10, 12) if s > done]
    assert first.evals[0] == 0 and 0 not in second.evals


def test_resume_from_the_last_step_returns_the_result(tmp_path: Path, references: dict) -> None:
    spec = make_spec("adamw", tmp_path / "state", checkpoint_every=4)
    train_plain(spec, CPU)  # checkpoints at 4, 8 and 12 (the last step)
    again = CrashAt()
    result = train_plain(spec, CPU, again)
    assert again.steps == [] and again.starts[0].resumed_from_step == 12
    assert_same_run(result, references["adamw"])


def test_no_state_dir_means_no_resume_and_no_files(tmp_path: Path, references: dict) -> None:
    with pytest.raises(ValueError, match="needs a state_dir"):
        make_spec(checkpoint_every=2)
    with pytest.raises(ValueError, match="checkpoint_every must be >= 1"):
        make_spec(state_dir=tmp_path, checkpoint_every=0)
    spec = make_spec("adamw", tmp_path / "state")  # resume from it, write nothing
    assert_same_run(train_plain(spec, CPU), references["adamw"])
    assert not (tmp_path / "state").exists()


# --- SIGKILL --------------------------------------------------------------------------------

def run_job(state_dir: str, optimizer: str, delay_s: float) -> None:
    """Entry point of the subprocess: train slowly with a checkpoint after every step."""
    train_plain(make_spec(optimizer, Path(state_dir), checkpoint_every=1), CPU,
                CrashAt(delay_s=delay_s))


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.path[:0] = [{str(ROOT)!r}]\n" + code]


def test_sigkill_mid_run_then_resume(
    tmp_path: Path, references: dict, caplog: pytest.LogCaptureFixture
) -> None:
    optimizer = "adamw"
    state_dir = tmp_path / "state"
    proc = subprocess.Popen(_python(
        f"from {__name__} import run_job; run_job({str(state_dir)!r}, {optimizer!r}, "
        "delay_s=0.3)"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            files = checkpoint_files(state_dir)
            if files and int(files[0].name[5:14]) >= 4:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_at = int(checkpoint_files(state_dir)[0].name[5:14])
    assert 4 <= killed_at < 12

    caplog.set_level(logging.INFO, LOG)
    callbacks = CrashAt()  # resumed here: the killed process shares nothing but the files
    resumed = train_plain(make_spec(optimizer, state_dir, checkpoint_every=1), CPU, callbacks)
    assert callbacks.starts[0].resumed_from_step == killed_at
    assert_same_run(resumed, references[optimizer])
    assert f"resuming job from {checkpoint_files(state_dir)[-1].parent}" in caplog.text
    assert not list(state_dir.glob(".tmp-*"))


# --- damaged, partial and foreign checkpoints -----------------------------------------------

@pytest.fixture
def three_checkpoints(tmp_path: Path) -> TrainSpec:
    spec = make_spec("adamw", tmp_path / "state", checkpoint_every=3, keep_checkpoints=3)
    with pytest.raises(Crash):
        train_plain(spec, CPU, CrashAt(11))  # checkpoints at 3, 6, 9
    assert len(checkpoint_files(spec.state_dir)) == 3
    return spec


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    elif how == "truncate":
        data = data[: len(data) // 3]
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "empty"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(
    how: str, three_checkpoints: TrainSpec, references: dict, caplog: pytest.LogCaptureFixture
) -> None:
    spec = three_checkpoints
    newest = checkpoint_files(spec.state_dir)[0]
    _damage(newest, how)
    caplog.set_level(logging.WARNING, LOG)
    state = load_latest(spec.state_dir, job_key(spec))
    assert state is not None and state.step == 6
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOG]
    assert line.startswith(f"ignoring checkpoint {newest}: ")
    assert "does not match its digest" in line

    callbacks = CrashAt()
    assert_same_run(train_plain(spec, CPU, callbacks), references["adamw"])
    assert callbacks.starts[0].resumed_from_step == 6
    assert not newest.exists()  # a later, unusable file is cleared by the next write


def test_leftovers_of_a_killed_write_and_foreign_checkpoints_are_ignored(
    three_checkpoints: TrainSpec, caplog: pytest.LogCaptureFixture
) -> None:
    spec = three_checkpoints
    state_dir = spec.state_dir
    files = checkpoint_files(state_dir)
    tmp = state_dir / ".tmp-step-000000012-abcd.ckpt"
    tmp.write_bytes(files[0].read_bytes()[:1000])  # what SIGKILL mid-write leaves
    other = make_spec("adamw", state_dir, seed=8)  # another job, same directory
    caplog.set_level(logging.WARNING, LOG)
    assert load_latest(state_dir, job_key(other)) is None
    messages = [r.getMessage() for r in caplog.records if r.name == LOG]
    assert f"{tmp}: deleting the temporary file of an interrupted checkpoint write" in messages
    assert sum("written for another job" in m for m in messages) == 3
    assert messages[-1] == f"no usable checkpoint in {state_dir}: the job starts from step 0"
    assert not tmp.exists()


def test_a_checkpoint_of_another_format_version_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import hashlib

    spec = make_spec()
    key = job_key(spec)
    state = TrainingState(step=5, model={}, optimizer={})
    save_checkpoint(tmp_path, state, key)
    payload = {"format": "sweepmaster.training_state", "version": CHECKPOINT_VERSION + 1,
               "job_key": key, "step": 7}
    path = tmp_path / "x.ckpt"
    torch.save(payload, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    newer = path.rename(tmp_path / f"step-000000007-{digest}.ckpt")
    caplog.set_level(logging.WARNING, LOG)
    assert load_latest(tmp_path, key).step == 5
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOG]
    assert line == (f"ignoring checkpoint {newer}: format version {CHECKPOINT_VERSION + 1}, "
                    f"this sweepmaster reads version {CHECKPOINT_VERSION}")


def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    state = TrainingState(step=3, model={"w": torch.ones(3)}, optimizer={},
                          extra={"not saveable": lambda: None})
    with pytest.raises(Exception):  # noqa: B017 - whatever pickling raises
        save_checkpoint(tmp_path, state, "k")
    assert list(tmp_path.iterdir()) == []


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, TrainingState(step=step, model={}, optimizer={}), "k",
                        keep=2)
    assert [int(p.name[5:14]) for p in checkpoint_files(tmp_path)] == [4, 3]
    save_checkpoint(tmp_path, TrainingState(step=2, model={}, optimizer={}), "k", keep=2)
    assert [int(p.name[5:14]) for p in checkpoint_files(tmp_path)] == [2]  # 3, 4 abandoned
    state = load_latest(tmp_path, "k")
    assert dataclasses.astuple(state)[:3] == (2, {}, {})


def test_a_checkpoint_from_another_kind_of_device_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = TrainingState(step=4, model={}, optimizer={},
                          rng={"dropout:cuda": torch.zeros(16, dtype=torch.uint8)})
    path = save_checkpoint(tmp_path, state, "k")
    caplog.set_level(logging.WARNING, LOG)
    assert load_latest(tmp_path, "k", "cpu") is None
    assert f"ignoring checkpoint {path}: written on a cuda device, the job now runs on cpu" \
        in caplog.text
    assert load_latest(tmp_path, "k", "cuda").step == 4


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_optimizer_state_by_name_moves_between_layouts(optimizer: str) -> None:
    """State of one optimizer over the whole model continues in one optimizer per shard.

    What a trial checkpointed by plain training needs to resume spilled (and back): the numbers
    of the next steps are the same either way.
    """
    spec = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    sharded = copy.deepcopy(whole)
    names = [name for name, _ in whole.named_parameters()]
    one = build_optimizer(whole.parameters(), spec)
    x = torch.randn(16, 4)

    def step(model, optimizers) -> None:
        model(x).square().mean().backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)

    step(whole, [one])
    state = optimizer_state_by_name(one, names)
    assert set(state) == set(names)
    sharded.load_state_dict(whole.state_dict())
    shards = [build_optimizer(sharded[0].parameters(), spec),
              build_optimizer(sharded[2].parameters(), spec)]
    load_optimizer_state_by_name(shards[0], state, ["0.weight", "0.bias"])
    load_optimizer_state_by_name(shards[1], state, ["2.weight", "2.bias"])
    for _ in range(3):
        step(whole, [one])
        step(sharded, shards)
    for (name, expected), actual in zip(whole.state_dict().items(),
                                        sharded.state_dict().values(), strict=True):
        assert torch.equal(actual, expected), name
    merged = (optimizer_state_by_name(shards[0], ["0.weight", "0.bias"])
              | optimizer_state_by_name(shards[1], ["2.weight", "2.bias"]))
    for name, values in optimizer_state_by_name(one, names).items():
        for key, value in values.items():
            assert torch.equal(merged[name][key], value) if isinstance(value, torch.Tensor) \
                else merged[name][key] == value, (name, key)


def test_minibatch_order_resumes_at_any_step() -> None:
    full = [(e, idx.tolist()) for (e, idx), _ in zip(minibatch_indices(22, 4, 3), range(17),
                                                     strict=False)]
    for start in (0, 1, 4, 5, 6, 11, 16):
        resumed = [(e, idx.tolist()) for (e, idx), _ in
                   zip(minibatch_indices(22, 4, 3, start_step=start), range(17 - start),
                       strict=False)]
        assert resumed == full[start:], start


@pytest.mark.cuda
def test_resume_on_cuda_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    """The CUDA generator (dropout on the device) is saved and restored too."""
    device = Device("cuda:0")
    reference = train_plain(make_spec("adamw"), device)
    spec = make_spec("adamw", tmp_path / "state", checkpoint_every=3)
    with pytest.raises(Crash):
        train_plain(spec, device, CrashAt(8))
    torch.cuda.manual_seed(999)
    # allclose, not equal: CUDA's embedding backward adds with atomics in no fixed order
    assert_same_run(train_plain(spec, device, CrashAt()), reference, exact=False)
