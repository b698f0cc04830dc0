from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from sweepmaster.runtime import (
    Device,
    EvalEvent,
    ShardExecutor,
    StartEvent,
    StepEvent,
    TrainCallbacks,
    parse_devices,
    train_plain,
)
from sweepmaster.workload import OptimizerSpec, TrainSpec, make_blocks, tokenize_files
from tests.kit.data import TOKENIZER_DIR, WIKITEXT_DIR
from tests.kit.models import VOCAB, random_blocks
from tests.kit.models import tiny_gpt2 as tiny_config
from tests.kit.spill import OPTIMIZERS as SPILL_OPTIMIZERS
from tests.kit.threads import start_and_join

CPU = Device("cpu")
def reference_lr_factor(step: int, opt: OptimizerSpec, total_steps: int) -> float:
    if step < opt.warmup_steps:
        return step / opt.warmup_steps
    progress = min(1.0, (step - opt.warmup_steps) / max(1, total_steps - opt.warmup_steps))
    return {
        "constant": 1.0,
        "linear": 1.0 - progress,
        "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
    }[opt.schedule]


def reference_train(
    config, train_NT, opt: OptimizerSpec, batch_size, total_steps, seed, device="cpu"
):
    """Plain PyTorch training written from the documented recipe, independent of sweepmaster."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(device)
    model.train()
    params = list(model.parameters())
    if opt.name == "adamw":
        optimizer = torch.optim.AdamW(
            params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
    else:
        optimizer = torch.optim.SGD(
            params,
            lr=opt.lr,
            momentum=opt.momentum,
            weight_decay=opt.weight_decay,
            nesterov=opt.nesterov,
        )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: reference_lr_factor(s, opt, total_steps)
    )
    generator = torch.Generator().manual_seed(seed)
    num_blocks = train_NT.shape[0]
    losses = []
    while len(losses) < total_steps:
        perm = torch.randperm(num_blocks, generator=generator)
        for i in range(num_blocks // batch_size):
            if len(losses) == total_steps:
                break
            ids = train_NT[perm[i * batch_size : (i + 1) * batch_size]].to(device)
            loss = model(ids, labels=ids).loss  # transformers' own causal LM loss
            loss.backward()
            if opt.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, opt.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return model.state_dict(), losses


def assert_same_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].device.type == "cpu"
        assert torch.equal(actual[name], tensor), name


OPTIMIZERS = {"adamw": SPILL_OPTIMIZERS["adamw-clip"], "sgd": SPILL_OPTIMIZERS["sgd"]}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_train_plain_equals_reference_loop(opt_name: str) -> None:
    opt = OPTIMIZERS[opt_name]
    train_NT = random_blocks(10)  # 3 steps per epoch (batch 3), 8 steps: three epochs
    spec = TrainSpec(
        model=tiny_config(),
        train_data=train_NT,
        eval_data=random_blocks(4, seed=9),
        optimizer=opt,
        batch_size=3,
        max_steps=8,
        eval_every=3,
        seed=7,
    )
    result = train_plain(spec, CPU)
    expected_state, expected_losses = reference_train(tiny_config(), train_NT, opt, 3, 8, seed=7)
    assert_same_weights(result.state_dict, expected_state)
    assert [v for _, v in result.history("train_loss")] == expected_losses
    assert result.steps == 8 and result.tokens == 8 * 3 * 16 and not result.pruned


def test_metrics_lr_schedule_and_objective() -> None:
    opt = OptimizerSpec(lr=1e-3, warmup_steps=2, schedule="linear")
    spec = TrainSpec(
        model=tiny_config(),
        train_data=random_blocks(8),
        eval_data=random_blocks(3, seed=5),
        optimizer=opt,
        batch_size=2,
        epochs=1.5,
        eval_every=4,
        metric="eval_perplexity",
    )
    assert spec.total_steps == 6
    starts: list[StartEvent] = []
    steps: list[StepEvent] = []
    evals: list[EvalEvent] = []

    class Recorder(TrainCallbacks):
        def on_start(self, event):
            starts.append(event)

        def on_step(self, event):
            steps.append(event)

        def on_eval(self, event):
            evals.append(event)
            return False

    result = train_plain(spec, CPU, Recorder())
    assert [e.step for e in evals] == [0, 4, 6]
    assert [s.step for s in steps] == [1, 2, 3, 4, 5, 6]
    assert [s.epoch for s in steps] == [0, 0, 0, 0, 1, 1]
    assert starts[0].total_steps == 6 and starts[0].device == "cpu"
    assert starts[0].num_parameters == sum(
        p.numel() for p in AutoModelForCausalLM.from_config(tiny_config()).parameters()
    )
    lrs = [v for _, v in result.history("lr")]
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    assert [s.lr for s in steps] == lrs
    assert len(result.history("tokens_per_s")) == 6
    assert all(v > 0 for _, v in result.history("tokens_per_s"))
    eval_loss = result.history("eval_loss")
    assert [s for s, _ in eval_loss] == [0, 4, 6]
    assert result.history("eval_perplexity")[-1][1] == pytest.approx(math.exp(eval_loss[-1][1]))
    assert result.objective == result.history("eval_perplexity")[-1][1]
    assert [p.name for p in result.metrics[:5]] == [
        "eval_loss",
        "eval_perplexity",
        "train_loss",
        "lr",
        "tokens_per_s",
    ]


def test_objective_is_train_loss_without_eval_data() -> None:
    spec = TrainSpec(model=tiny_config(), train_data=random_blocks(4), batch_size=2, max_steps=3)
    result = train_plain(spec, CPU)
    assert result.objective == result.history("train_loss")[-1][1]
    assert result.history("eval_loss") == []


def test_evaluation_does_not_disturb_training_rng() -> None:
    config = tiny_config(resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)
    common = {
        "model": config,
        "train_data": random_blocks(8),
        "eval_data": random_blocks(5, seed=3),
        "batch_size": 2,
        "max_steps": 6,
        "eval_max_blocks": 3,
        "seed": 11,
    }
    every_step = train_plain(TrainSpec(eval_every=1, **common), CPU)
    ends_only = train_plain(TrainSpec(eval_every=None, **common), CPU)
    assert len(every_step.history("eval_loss")) == 7 and len(ends_only.history("eval_loss")) == 2
    assert every_step.history("train_loss") == ends_only.history("train_loss")
    assert every_step.history("eval_loss")[-1] == ends_only.history("eval_loss")[-1]
    assert_same_weights(every_step.state_dict, ends_only.state_dict)
    # dropout is really on: another seed gives other numbers
    other = train_plain(TrainSpec(eval_every=None, **{**common, "seed": 12}), CPU)
    assert other.history("train_loss") != ends_only.history("train_loss")


def test_eval_loss_falls_on_wikitext(tmp_path: Path) -> None:
    ids = tokenize_files(
        [WIKITEXT_DIR / "wiki.valid.tokens"],
        TOKENIZER_DIR,
        max_tokens=20_000,
        cache_dir=tmp_path,
    )
    # Real WikiText-2 token blocks, ids renumbered to the ones that occur (a compact vocabulary
    # keeps the logits small enough for a few-second test on 2 CPU cores).
    used, compact_ids = torch.unique(ids, return_inverse=True)
    blocks = make_blocks(compact_ids, 32)
    spec = TrainSpec(
        model=tiny_config(vocab_size=len(used)),
        train_data=blocks[:-16],
        eval_data=blocks[-16:],
        optimizer=OptimizerSpec(lr=1e-2, warmup_steps=3),
        batch_size=8,
        max_steps=30,
        eval_every=15,
    )
    result = train_plain(spec, CPU)
    losses = [v for _, v in result.history("eval_loss")]
    assert len(losses) == 3
    assert losses[0] == pytest.approx(math.log(len(used)), abs=0.5)  # random init
    assert losses[2] < losses[1] < losses[0] - 1.0
    assert result.objective == losses[2]


def test_pruning_by_callback(tmp_path: Path) -> None:
    class PruneAtStep2(TrainCallbacks):
        def on_eval(self, event):
            return event.step >= 2

    spec = TrainSpec(
        model=tiny_config(),
        train_data=random_blocks(8),
        eval_data=random_blocks(2),
        batch_size=2,
        max_steps=10,
        eval_every=2,
        checkpoint_dir=tmp_path / "ckpt",
    )
    result = train_plain(spec, CPU, PruneAtStep2())
    assert result.pruned and result.steps == 2 < spec.total_steps
    assert result.objective == result.history("eval_loss")[-1][1]
    assert result.checkpoint_path is None and not (tmp_path / "ckpt").exists()


def test_pruning_at_step_zero() -> None:
    class PruneNow(TrainCallbacks):
        def on_eval(self, event):
            return True

    spec = TrainSpec(
        model=tiny_config(),
        train_data=random_blocks(4),
        eval_data=random_blocks(2),
        batch_size=2,
        max_steps=5,
    )
    result = train_plain(spec, CPU, PruneNow())
    assert result.pruned and result.steps == 0 and result.tokens == 0
    assert result.history("train_loss") == []


def test_checkpoint_is_reloadable(tmp_path: Path) -> None:
    spec = TrainSpec(
        model=tiny_config(),
        train_data=random_blocks(4),
        batch_size=2,
        max_steps=2,
        checkpoint_dir=tmp_path / "best",
    )
    result = train_plain(spec, CPU)
    assert result.checkpoint_path == tmp_path / "best"
    reloaded = AutoModelForCausalLM.from_pretrained(result.checkpoint_path, local_files_only=True)
    assert_same_weights(reloaded.state_dict(), result.state_dict)


class BigramLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids_BT):
        return self.head(self.drop(self.embed(input_ids_BT)))


def test_plain_module_factory_and_checkpoint(tmp_path: Path) -> None:
    spec = TrainSpec(
        model=BigramLM,
        train_data=random_blocks(6),
        eval_data=random_blocks(2),
        batch_size=2,
        max_steps=4,
        checkpoint_dir=tmp_path / "ckpt",
        optimizer=OptimizerSpec(name="sgd", lr=0.1),
    )
    result = train_plain(spec, CPU)
    state = torch.load(tmp_path / "ckpt" / "model.pt", weights_only=True)
    assert_same_weights(state, result.state_dict)


def test_non_finite_loss_raises_naming_the_step() -> None:
    spec = TrainSpec(
        model=tiny_config(),
        train_data=random_blocks(8),
        batch_size=2,
        max_steps=6,
        optimizer=OptimizerSpec(name="sgd", lr=1e30),
    )
    with pytest.raises(FloatingPointError, match=r"non-finite train loss .* at step \d"):
        train_plain(spec, CPU)


def test_invalid_specs() -> None:
    with pytest.raises(ValueError, match="eval_every"):
        train_plain(
            TrainSpec(
                model=tiny_config(), train_data=random_blocks(4), batch_size=2, eval_every=0
            ),
            CPU,
        )
    with pytest.raises(ValueError, match="2 tokens"):
        train_plain(
            TrainSpec(model=tiny_config(), train_data=random_blocks(4, 1), batch_size=2), CPU
        )


# ---------------------------------------------------------------- devices and executor


def test_parse_devices() -> None:
    assert parse_devices("cpu") == [Device("cpu")]
    assert Device("cpu").torch_device == torch.device("cpu")
    if not torch.cuda.is_available():
        assert parse_devices("auto") == [Device("cpu")]
        with pytest.raises(ValueError, match="no CUDA device"):
            parse_devices("cuda:0")
    else:
        assert parse_devices("auto")[0] == Device("cuda:0")
        assert parse_devices("cuda") == [Device("cuda:0")]
    for bad in ("tpu", "", "cpu,,cpu", "cpu,cpu", "cuda:x"):
        with pytest.raises(ValueError):
            parse_devices(bad)


def test_the_host_cpu_trains_jobs_submitted_at_once_each_exactly() -> None:
    # Jobs that fit the host CPU are one shard each, a task per step, their tensors used in
    # place: whatever order their steps interleave in, each ends with its plain training.
    steps: dict[str, list[int]] = {"a": [], "bb": []}

    class Recorder(TrainCallbacks):
        def on_step(self, event):
            steps[event.job].append(event.step)

    def spec(name: str) -> TrainSpec:
        return TrainSpec(model=tiny_config(), train_data=random_blocks(6), batch_size=2,
                         max_steps=4, name=name, seed=len(name))

    results: dict[str, object] = {}
    executor = ShardExecutor("cpu")
    assert executor.devices == [Device("cpu")]

    def run(name: str) -> None:
        results[name] = executor.fit(spec(name), Recorder())

    with executor:
        start_and_join([threading.Thread(target=run, args=(n,)) for n in ("a", "bb")],
                       timeout_s=60)
    assert set(results) == {"a", "bb"}
    assert steps == {"a": [1, 2, 3, 4], "bb": [1, 2, 3, 4]}
    for name, result in results.items():
        assert result.steps == 4 and result.device == "cpu"  # type: ignore[attr-defined]
        assert result.swap_bytes == 0  # type: ignore[attr-defined]
        expected = train_plain(spec(name), Device("cpu"))
        assert_same_weights(result.state_dict, expected.state_dict)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="closed"):
        executor.fit(TrainSpec(model=tiny_config(), train_data=random_blocks(2), batch_size=2))


def test_concurrent_cpu_jobs_keep_their_own_dropout_streams() -> None:
    """Two jobs training at once on two virtual CPU devices equal each one trained alone.

    Both draw dropout from the process's CPU generator; each must see only its own stream.
    """
    specs = {name: TrainSpec(model=tiny_config(), train_data=random_blocks(12), batch_size=3,
                             max_steps=8, seed=seed, name=name)
             for name, seed in (("a", 1), ("b", 2))}
    executor = ShardExecutor("cpu:2x512MiB", spill="never")
    alone = {name: executor.fit(spec) for name, spec in specs.items()}
    together: dict[str, object] = {}
    barrier = threading.Barrier(2)

    class InStep(TrainCallbacks):  # both jobs step at the same time
        def on_start(self, event):
            barrier.wait(timeout=60)

    start_and_join([threading.Thread(target=lambda n=n: together.__setitem__(
        n, executor.fit(specs[n], InStep()))) for n in specs], timeout_s=120)
    executor.close()
    for name in specs:
        assert_same_weights(together[name].state_dict, alone[name].state_dict)  # type: ignore


def test_executor_frees_device_after_exception() -> None:
    bad = TrainSpec(
        model=tiny_config(),
        train_data=random_blocks(4),
        batch_size=2,
        max_steps=4,
        optimizer=OptimizerSpec(name="sgd", lr=1e30),
    )
    good = TrainSpec(model=tiny_config(), train_data=random_blocks(4), batch_size=2, max_steps=1)
    with ShardExecutor([CPU]) as executor:
        with pytest.raises(FloatingPointError):
            executor.fit(bad)
        assert executor.fit(good).steps == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_train_plain_on_cuda_matches_reference_loop() -> None:
    opt = OPTIMIZERS["adamw"]
    config = tiny_config(resid_pdrop=0.2)
    train_NT = random_blocks(10)
    spec = TrainSpec(
        model=config,
        train_data=train_NT,
        eval_data=random_blocks(4, seed=9),
        optimizer=opt,
        batch_size=3,
        max_steps=8,
        eval_every=2,
        seed=7,
    )
    result = train_plain(spec, Device("cuda:0"))
    expected, _ = reference_train(config, train_NT, opt, 3, 8, seed=7, device="cuda:0")
    for name, tensor in expected.items():
        torch.testing.assert_close(result.state_dict[name], tensor.cpu(), rtol=1e-5, atol=1e-6)
