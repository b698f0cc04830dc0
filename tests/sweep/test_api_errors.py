"""The Python API's bad-input catalogue: a researcher's mistakes, refused before anything trains.

Each case makes one realistic mistake with ``TrainSpec``, ``OptimizerSpec`` or the
``Executor`` and must get a ``ValueError`` / ``TypeError`` (or sweepmaster's own error) when the
value enters (the spec is made, the executor is made, the job is submitted), whose message names
the argument and what it takes, raised by sweepmaster's code, not from deep inside torch or
transformers. No case trains: a submitted job that fails is refused by ``submit`` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import GPT2Config

import sweepmaster
from sweepmaster.runtime import ShardExecutor
from sweepmaster.runtime.devices.device import VirtualDevice
from sweepmaster.runtime.events import TrainCallbacks
from tests.kit.models import random_blocks, tiny_gpt2

VOCAB = 101
PACKAGE = Path(sweepmaster.__file__).parent


def tiny_config() -> GPT2Config:
    return tiny_gpt2(n_layer=1, n_positions=16, vocab_size=VOCAB)


def blocks(num_blocks: int = 16, block_size: int = 16) -> torch.Tensor:
    return random_blocks(num_blocks, block_size, seed=0, vocab_size=VOCAB)


def spec(**overrides: Any) -> sweepmaster.TrainSpec:
    """A valid tiny spec with ``overrides`` applied."""
    fields: dict[str, Any] = {
        "model": tiny_config(), "train_data": blocks(), "eval_data": blocks(4),
        "optimizer": sweepmaster.OptimizerSpec(name="adamw", lr=1e-3),
        "batch_size": 4, "max_steps": 2, "seed": 0,
    }
    fields.update(overrides)
    return sweepmaster.TrainSpec(**fields)


def optimizer(**fields: Any) -> Callable[[], Any]:
    return lambda: sweepmaster.OptimizerSpec(**fields)


def train_spec(**overrides: Any) -> Callable[[], Any]:
    return lambda: spec(**overrides)


def executor(*args: Any, **kwargs: Any) -> Callable[[], Any]:
    def make() -> None:
        sweepmaster.Executor(*args, **kwargs).close()

    return make


class Built(nn.Module):
    """A causal LM passed built instead of as a factory."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids


class MeanOverPositions(nn.Module):
    """Averages over T: the model returns ``(B, V)`` instead of ``(B, T, V)``."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.mean(dim=1)


class Nothing(nn.Module):
    """Returns ``None`` instead of logits."""

    def forward(self, hidden: torch.Tensor) -> None:
        return None


def per_sequence_logits() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB), MeanOverPositions())


def no_logits() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 8), Nothing())


def submit(make_spec: Callable[[], Any]) -> Callable[[], Any]:
    """Submit one job on the host CPU; the error must come from ``submit`` itself."""

    def run() -> None:
        with sweepmaster.Executor(devices="cpu") as ex:
            ex.submit(make_spec())

    return run


def submit_after_close() -> None:
    ex = sweepmaster.Executor(devices="cpu")
    ex.close()
    ex.fit(spec())


def fit_with_callbacks_as_trial() -> None:
    with sweepmaster.Executor(devices="cpu") as ex:
        ex.fit(spec(), TrainCallbacks())


def optuna_submit_fused(specs: Callable[[], Any], **kwargs: Any) -> Callable[[], Any]:
    def run() -> None:
        with sweepmaster.Executor(devices="cpu") as ex:
            ex.submit_fused(specs(), **kwargs)

    return run


def submit_fused(specs: Callable[[], Any], devices: str = "cpu",
                 **kwargs: Any) -> Callable[[], Any]:
    def run() -> None:
        with ShardExecutor(devices=devices, **kwargs) as ex:
            ex.submit_fused(specs())

    return run


@dataclass
class Case:
    """One mistake: how to make it, the error type and what its message must contain."""

    id: str
    make: Callable[[], Any]
    error: type[BaseException]
    fragments: tuple[str, ...]


CASES = [
    # ------------------------------------------------------------------ TrainSpec data
    Case("float-train-data", train_spec(train_data=blocks().float()), TypeError,
         ("train_data", "int64", "torch.float32", ".long()")),
    Case("list-train-data", train_spec(train_data=blocks().tolist()), TypeError,
         ("train_data", "torch.Tensor", "list", "torch.as_tensor")),
    Case("1d-train-data", train_spec(train_data=blocks().flatten()), ValueError,
         ("train_data", "(N, T)", "T >= 2 tokens", "(256,)")),
    Case("ids-past-vocab", train_spec(train_data=blocks() + VOCAB), ValueError,
         ("train_data", "outside the model's vocabulary [0, 101)", "vocab_size")),
    Case("negative-ids", train_spec(train_data=blocks() - VOCAB), ValueError,
         ("train_data", "token id -", "[0, 101)")),
    Case("eval-ids-past-vocab", train_spec(eval_data=blocks(4) + VOCAB), ValueError,
         ("eval_data", "outside the model's vocabulary")),
    Case("float-eval-data", train_spec(eval_data=blocks(4).float()), TypeError,
         ("eval_data", "int64")),
    Case("blocks-past-n-positions", train_spec(train_data=blocks(16, 32), eval_data=None),
         ValueError, ("train_data", "T = 32", "16 positions", "n_positions")),
    # ------------------------------------------------------------------ TrainSpec counts
    Case("batch-size-zero", train_spec(batch_size=0), ValueError,
         ("batch_size must be an integer >= 1", "got 0")),
    Case("batch-size-float", train_spec(batch_size=4.0), TypeError,
         ("batch_size", "integer", "float")),
    Case("batch-size-past-rows", train_spec(batch_size=17), ValueError,
         ("train_data has 16 blocks, fewer than one batch of 17",)),
    Case("max-steps-zero", train_spec(max_steps=0), ValueError, ("max_steps", ">= 1", "got 0")),
    Case("max-steps-negative", train_spec(max_steps=-5), ValueError, ("max_steps", "got -5")),
    Case("epochs-zero", train_spec(max_steps=None, epochs=0), ValueError, ("epochs", "> 0")),
    Case("eval-every-zero", train_spec(eval_every=0), ValueError, ("eval_every", ">= 1")),
    Case("metric-typo", train_spec(metric="eval_los"), ValueError,
         ("metric", "'eval_loss'", "'eval_los'")),
    Case("dtype-typo", train_spec(dtype="fp16"), ValueError, ("dtype", "'bfloat16'", "'fp16'")),
    Case("optimizer-as-string", train_spec(optimizer="adamw"), TypeError,
         ("optimizer must be an OptimizerSpec",)),
    # ------------------------------------------------------------------ TrainSpec model
    Case("built-module", train_spec(model=Built()), TypeError,
         ("model must be a factory", "not a built Built")),
    Case("hub-name-not-cached", train_spec(model="smtest/not-cached"), sweepmaster.DataError,
         ("TrainSpec.model: a directory saved with save_pretrained or a HuggingFace hub id, "
          "got smtest/not-cached (no such directory, and not in the HuggingFace cache",
          "HF_HUB_OFFLINE is set")),
    # ------------------------------------------------------------------ OptimizerSpec
    Case("optimizer-typo", optimizer(name="adam"), ValueError,
         ("OptimizerSpec.name", "'adamw', 'sgd'", "'adam'")),
    Case("schedule-typo", optimizer(schedule="cos"), ValueError,
         ("OptimizerSpec.schedule", "'cosine'")),
    Case("negative-lr", optimizer(lr=-1e-3), ValueError, ("OptimizerSpec.lr", ">= 0")),
    Case("string-lr", optimizer(lr="1e-3"), TypeError, ("OptimizerSpec.lr", "str")),
    Case("negative-weight-decay", optimizer(weight_decay=-0.1), ValueError,
         ("OptimizerSpec.weight_decay",)),
    Case("beta-past-one", optimizer(betas=(0.9, 1.5)), ValueError,
         ("OptimizerSpec.betas[1]", "[0, 1)")),
    Case("nesterov-without-momentum", optimizer(name="sgd", nesterov=True), ValueError,
         ("nesterov", "momentum > 0")),
    Case("negative-warmup", optimizer(warmup_steps=-1), ValueError,
         ("OptimizerSpec.warmup_steps", ">= 0")),
    Case("zero-grad-clip", optimizer(grad_clip=0.0), ValueError,
         ("OptimizerSpec.grad_clip", "> 0 or None")),
    # ------------------------------------------------------------------ Executor arguments
    Case("device-typo", executor(devices="cuda0"), ValueError, ("unknown device 'cuda0'",)),
    Case("device-memory-without-unit", executor(devices="cpu", device_memory="512"), ValueError,
         ("device_memory '512' has no unit", "'512MiB'")),
    Case("devices-as-list-of-strings", executor(devices=["cpu"]), TypeError,
         ("devices must be a device spec string", "Device objects")),
    Case("device-memory-with-device-objects",
         executor(devices=[VirtualDevice("cpu:0", budget_bytes=2**26)], device_memory="1GiB"),
         ValueError, ("device_memory", "spec string")),
    Case("microbatch-zero", executor(devices="cpu", microbatch_size=0), ValueError,
         ("microbatch_size", ">= 1")),
    Case("fusion-bogus", executor(devices="cpu", fusion="bogus"), ValueError,
         ("fusion", "auto, off or an integer >= 1", "'bogus'")),
    # ------------------------------------------------------------------ Executor methods
    Case("fit-after-close", submit_after_close, RuntimeError,
         ("the Executor is closed", "create a new Executor")),
    Case("submit-not-a-spec", submit(GPT2Config), TypeError,
         ("spec must be a TrainSpec", "GPT2Config")),
    Case("model-returns-per-sequence-logits", submit(lambda: spec(model=per_sequence_logits,
                                                                  eval_data=None)),
         ValueError, ("logits of shape (4, 101)", "input ids of shape (4, 16)", "(B, T, V)")),
    Case("model-returns-none", submit(lambda: spec(model=no_logits, eval_data=None)), TypeError,
         ("the model returned NoneType", "(B, T, V)")),
    Case("fused-one-spec", submit_fused(spec), TypeError,
         ("sequence of TrainSpecs", "use submit")),
    Case("fit-callbacks-as-trial", fit_with_callbacks_as_trial, TypeError,
         ("trial must be an Optuna trial", "TrainCallbacks", "callbacks=")),
    Case("optuna-fused-one-spec", optuna_submit_fused(spec), TypeError,
         ("sequence of TrainSpecs", "use submit")),
    Case("optuna-fused-trials-not-trials",
         optuna_submit_fused(lambda: [spec(name="a"), spec(name="b")], trials=[0.1, 0.2]),
         TypeError, ("trial must be an Optuna trial", "got float")),
    Case("fused-mixed-batch-size",
         submit_fused(lambda: [spec(name="a"), spec(name="b", batch_size=8)]), ValueError,
         ("specs[1] ('b') cannot fuse with specs[0] ('a')", "batch_size 4 vs 8")),
    Case("fused-mixed-model",
         submit_fused(lambda: [spec(), spec(model=GPT2Config(
             n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=VOCAB))]), ValueError,
         ("specs[1]", "model config")),
    Case("fused-mixed-optimizer-spilled",
         submit_fused(lambda: [spec(), spec(optimizer=sweepmaster.OptimizerSpec(name="sgd"))],
                      devices="cpu:1x2MiB", spill="always"), ValueError,
         ("specs[1]", "optimizer 'adamw' vs 'sgd'")),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_mistake_is_refused_with_a_message_naming_it(case: Case) -> None:
    with pytest.raises(case.error) as excinfo:
        case.make()
    message = str(excinfo.value)
    for fragment in case.fragments:
        assert fragment in message
    assert "\n" not in message
    raised_in = Path(str(excinfo.traceback[-1].path)).resolve()
    assert PACKAGE in raised_in.parents, f"raised from {raised_in}, not by sweepmaster"


def test_every_field_of_a_valid_spec_survives_the_checks() -> None:
    made = spec(eval_every=1, eval_max_blocks=2, metric="train_loss", dtype="bfloat16",
                optimizer=sweepmaster.OptimizerSpec(name="sgd", lr=0.0, momentum=0.9,
                                                    nesterov=True, betas=[0.8, 0.9]))
    assert made.optimizer.betas == (0.8, 0.9)
    assert made.total_steps == 2
