"""One conformance suite over every job shape: K members x S shards equal plain training.

A job is K >= 1 members of one architecture cut into S >= 1 shards. Each combination of
K in {1, 3}, S in {1, 3}, AdamW / SGD, ``grad_clip`` off / 1.0 and prefetch on / off trains
through the executor's public entry point (:meth:`ShardExecutor.submit_fused`, which the sweep
calls; K = 1 is an ordinary spilled job) on a virtual device, with dropout on, and each member ends
with the weights of :func:`train_plain`. Spilled jobs (S = 3) run their mu-TWO memory plan
(the executor's default), and again recomputing every activation (``plan_activations=False``).
Then, for each (K, S): a run killed after a step and launched again from its members'
checkpoints ends with the weights of the uninterrupted run. Last, jobs of every kind (one that
fits, one that spills, a fused array that fits, one that spills) share one executor with default
settings, on one and on two virtual devices. And with loss masks (prompt tokens and padding
that do not count), each path (resident, spilled, fused, LoRA, pipelined) equals plain training
on the same masked batches, in microbatches, and plain's loss is transformers' own.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config

from sweepmaster.runtime import (
    Device,
    ShardExecutor,
    StepEvent,
    TrainCallbacks,
    VirtualDevice,
    train_pipelined,
    train_plain,
)
from sweepmaster.runtime.training.training_state import checkpoint_files
from sweepmaster.workload import OptimizerSpec, TrainSpec
from sweepmaster.workload.spec import LoraSpec, TrainResult
from tests.kit.models import tiny_gpt2

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

KiB = 2**10
CPU = Device("cpu")
VOCAB = 64
#: Budgets (bytes) under which the tiny model below is planned as S = 3 shards (embedding,
#: two blocks and head: 4 layers), per optimizer and K; S = 1 fits ONE_SHARD.
THREE_SHARDS = {("adamw", 1): 256 * KiB, ("adamw", 3): 784 * KiB,
                ("sgd", 1): 216 * KiB, ("sgd", 3): 680 * KiB,
                ("lion", 1): 224 * KiB, ("lion", 3): 680 * KiB}
ONE_SHARD = 4096 * KiB


def config() -> GPT2Config:
    return tiny_gpt2(dropout=0.1, n_positions=16, vocab_size=VOCAB)


def blocks(num_blocks: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (num_blocks, 8), generator=torch.Generator().manual_seed(seed))


TRAIN, EVAL = blocks(12, 0), blocks(4, 1)


def loss_mask(num_blocks: int, seed: int) -> torch.Tensor:
    """Per block a prompt (not counted), then completion tokens, then padding (not counted):
    blocks count different numbers of targets, so microbatches' shares differ from their rows'."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(1, 7, (num_blocks, 1), generator=generator)
    stop = start + 1 + torch.randint(0, 8, (num_blocks, 1), generator=generator)
    positions = torch.arange(8)
    return (positions >= start) & (positions < stop)


TRAIN_MASK, EVAL_MASK = loss_mask(12, 2), loss_mask(4, 3)


def member(k: int, opt_name: str, grad_clip: float | None, **overrides) -> TrainSpec:
    """Member k: its own seed and learning rate; 3 steps of 4 blocks, evaluated at 0, 2, 3."""
    if opt_name == "sgd":
        opt = OptimizerSpec(name="sgd", lr=0.1 * (1 + k), momentum=0.9, grad_clip=grad_clip)
    elif opt_name == "lion":
        opt = OptimizerSpec(name="lion", lr=1e-4 * (1 + k), betas=(0.9 - 0.05 * k, 0.99),
                            weight_decay=0.1, grad_clip=grad_clip)
    else:
        opt = OptimizerSpec(name="adamw", lr=1e-3 * (1 + k), weight_decay=0.01,
                            grad_clip=grad_clip)
    values = {"eval_data": EVAL, "batch_size": 4, "max_steps": 3, "eval_every": 2,
              "seed": 11 + k, "name": f"m{k}", "optimizer": opt}
    values.update(overrides)
    return TrainSpec(config(), TRAIN, **values)


_PLAIN: dict[tuple, TrainResult] = {}


def plain(spec: TrainSpec) -> TrainResult:
    """``train_plain`` of a member (every combination shares the K = 1 member's run)."""
    key = (spec.name, repr(spec.optimizer), spec.max_steps, spec.eval_data is None,
           spec.train_mask is not None, repr(spec.peft))
    if key not in _PLAIN:
        _PLAIN[key] = train_plain(dataclasses.replace(spec, state_dir=None,
                                                      checkpoint_every=None), CPU)
    return _PLAIN[key]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def without_noise_gradients(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` less GPT-2's key biases, whose gradient is rounding noise.

    Softmax is shift-invariant, so a key bias's gradient is zero in exact arithmetic and its
    sign is that of rounding noise, which batched kernels (K > 1) change: Lion steps such a
    weight by lr whichever way its noise points. Every other weight is held to the tolerance.
    """
    kept = {}
    for name, weight in weights.items():
        if name.endswith("attn.c_attn.bias"):  # (query, key, value) biases
            n_embd = weight.shape[0] // 3
            weight = torch.cat([weight[:n_embd], weight[2 * n_embd:]])
        kept[name] = weight
    return kept


def assert_same_history(got: TrainResult, want: TrainResult, metric: str, rel: float) -> None:
    (got_steps, got_values), (want_steps, want_values) = (
        zip(*result.history(metric), strict=True) for result in (got, want))
    assert got_steps == want_steps
    assert got_values == pytest.approx(want_values, rel=rel)


def tolerance(spec: TrainSpec) -> float:
    """fp32: SGD within 1e-6; AdamW divides by sqrt(v), so rounding noise of batched kernels
    becomes lr-sized steps where a gradient is ~0 (as in tests/runtime/test_fusion.py); Lion
    steps by lr times a sign, alike (see :func:`without_noise_gradients`)."""
    return 1e-6 if spec.optimizer.name == "sgd" else 1e-2 * spec.optimizer.lr


def train(specs: list[TrainSpec], num_shards: int, *, prefetch: bool = True,
          callbacks: list[TrainCallbacks | None] | None = None,
          plan_activations: bool = True, update_on: str = "auto") -> list:
    """Train ``specs`` as one job through the executor; per member its result or error.

    With ``plan_activations``, a job of 3 shards runs its memory plan (checked to exist);
    ``update_on`` is the executor's (a job of 3 shards checked to update there)."""
    opt_name = specs[0].optimizer.name
    budget = THREE_SHARDS[opt_name, len(specs)] if num_shards == 3 else ONE_SHARD
    with ShardExecutor(f"cpu:1x{budget}", spill="always", prefetch=prefetch,
                  plan_activations=plan_activations, update_on=update_on) as executor:
        plan = executor.plan(specs[0]) if len(specs) == 1 else \
            executor.stacked_plan(specs[0], len(specs))
        assert len(plan.shards) == num_shards
        if num_shards == 3 and update_on != "auto":
            assert plan.update_on == update_on
        memory = executor.memory_plan(specs[0]) if len(specs) == 1 else \
            executor.memory_plan(executor.fused_spec(specs), len(specs))
        assert (memory is not None) == (plan_activations and num_shards == 3)
        futures = executor.submit_fused(specs, callbacks)
        outcomes = []
        for future in futures:
            error = future.exception()
            outcomes.append(error if error is not None else future.result())
    return outcomes


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("grad_clip", [None, 1.0], ids=["noclip", "clip"])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd", "lion"])
@pytest.mark.parametrize("num_shards", [1, 3], ids=["S1", "S3"])
@pytest.mark.parametrize("num_members", [1, 3], ids=["K1", "K3"])
def test_every_member_ends_with_plain_trainings_weights(
    num_members: int, num_shards: int, opt_name: str, grad_clip: float | None, prefetch: bool
) -> None:
    assert_plain_weights(num_members, num_shards, opt_name, grad_clip, prefetch, True)


@pytest.mark.parametrize("grad_clip", [None, 1.0], ids=["noclip", "clip"])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd", "lion"])
@pytest.mark.parametrize("num_members", [1, 3], ids=["K1", "K3"])
def test_every_member_ends_with_plain_trainings_weights_recomputing_every_activation(
    num_members: int, opt_name: str, grad_clip: float | None
) -> None:
    """The S = 3 cases above without a memory plan (Hydra's full recompute)."""
    assert_plain_weights(num_members, 3, opt_name, grad_clip, True, False)


@pytest.mark.usefixtures("late_copy_thread")
@pytest.mark.parametrize("plan_activations", [False, True], ids=["recompute", "memory-plan"])
@pytest.mark.parametrize("num_members", [1, 3], ids=["K1", "K3"])
def test_copy_threads_that_run_late_change_no_peak(num_members: int,
                                                   plan_activations: bool) -> None:
    """Prefetched shards and swapped activations leave the device when the job drops them,
    however late its copy threads run (budgets here leave no slack for a copy thread's lag)."""
    assert_plain_weights(num_members, 3, "adamw", 1.0, True, plan_activations)


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
@pytest.mark.parametrize("num_members", [1, 3], ids=["K1", "K3"])
def test_updates_on_the_host_end_with_plain_trainings_weights(num_members: int,
                                                              opt_name: str) -> None:
    """ZeRO-Offload's host update (spilled, S = 3): the same numbers as the device's."""
    assert_plain_weights(num_members, 3, opt_name, None, True, True, update_on="host")


def assert_plain_weights(num_members: int, num_shards: int, opt_name: str,
                         grad_clip: float | None, prefetch: bool, plan_activations: bool,
                         update_on: str = "auto") -> None:
    specs = [member(k, opt_name, grad_clip) for k in range(num_members)]
    results = train(specs, num_shards, prefetch=prefetch, plan_activations=plan_activations,
                    update_on=update_on)
    for spec, result in zip(specs, results, strict=True):
        assert isinstance(result, TrainResult), result
        expected = plain(spec)
        got, want = result.state_dict, expected.state_dict
        if opt_name == "lion" and num_members > 1:
            got, want = without_noise_gradients(got), without_noise_gradients(want)
        diff = max_abs_diff(got, want)
        print(f"K={num_members} S={num_shards} {opt_name} clip={grad_clip} "
              f"prefetch={prefetch} memory plan={plan_activations and num_shards == 3} "
              f"update on {update_on} "
              f"{spec.name}: "
              f"max abs weight diff {diff:.3g}")
        assert diff <= tolerance(spec)
        assert result.steps == 3 and result.swap_bytes > 0
        for metric in ("train_loss", "eval_loss"):
            assert_same_history(result, expected, metric, rel=1e-5)
    if grad_clip is not None:  # the clip bites: unclipped training ends elsewhere
        unclipped = dataclasses.replace(specs[0].optimizer, grad_clip=None)
        moved = max_abs_diff(plain(dataclasses.replace(specs[0], optimizer=unclipped)).state_dict,
                             plain(specs[0]).state_dict)
        assert moved > 10 * tolerance(specs[0])


class Interrupt(BaseException):
    """Ends the whole job, as a killed worker does (an ``Exception`` fails one member)."""


class KillAfter(TrainCallbacks):
    def __init__(self, step: int | None) -> None:
        self.step = step
        self.steps: list[int] = []

    def on_step(self, event: StepEvent) -> None:
        self.steps.append(event.step)
        if event.step == self.step:
            raise Interrupt(f"killed after step {event.step}")


#: Checkpoint cadences of members 0..2: killed after step 6 (before its checkpoint), they
#: resume from steps 4, 3 and 5.
EVERY = (4, 3, 5)


@pytest.mark.parametrize("num_shards", [1, 3], ids=["S1", "S3"])
@pytest.mark.parametrize("num_members", [1, 3], ids=["K1", "K3"])
def test_a_killed_job_resumes_each_member_exactly(
    tmp_path: Path, num_members: int, num_shards: int
) -> None:
    """AdamW with grad_clip, no evaluation: the deferred clipped updates land before a save."""

    def specs(root: Path | None) -> list[TrainSpec]:
        return [member(k, "adamw", 1.0, max_steps=7, eval_data=None, eval_every=None,
                       state_dir=None if root is None else root / f"m{k}",
                       checkpoint_every=None if root is None else EVERY[k])
                for k in range(num_members)]

    uninterrupted = train(specs(None), num_shards)
    killed = specs(tmp_path)
    first = [KillAfter(6)] + [KillAfter(None) for _ in killed[1:]]
    outcomes = train(killed, num_shards, callbacks=list(first))
    assert all(isinstance(outcome, Interrupt) for outcome in outcomes)
    done = [5 // every * every for every in EVERY[:num_members]]  # the last before step 6
    for spec, step in zip(killed, done, strict=True):
        assert spec.state_dir is not None
        assert int(checkpoint_files(spec.state_dir)[0].name[5:14]) == step

    torch.manual_seed(999)  # the process's generator moved on meanwhile
    second = [KillAfter(None) for _ in killed]
    resumed = train(killed, num_shards, callbacks=list(second))
    for k, (got, want) in enumerate(zip(resumed, uninterrupted, strict=True)):
        assert isinstance(got, TrainResult) and isinstance(want, TrainResult)
        diff = max_abs_diff(got.state_dict, want.state_dict)
        print(f"K={num_members} S={num_shards} m{k}: resumed from step {done[k]}, "
              f"max abs weight diff {diff:.3g}")
        assert diff <= 1e-6
        assert got.steps == 7
        assert second[k].steps == list(range(done[k] + 1, 8))  # no finished step redone
        assert_same_history(got, want, "train_loss", rel=1e-6)


@pytest.mark.parametrize("num_devices", [1, 2])
def test_jobs_of_every_kind_share_one_executor_with_default_settings(num_devices: int) -> None:
    """A job that fits, a spilled job, a fused array that fits and a spilled fused array, all
    submitted at once to one executor with default settings: each member equals plain training
    and every metered peak stays within the device budget."""
    budget = 1600 * KiB
    deep = GPT2Config(n_layer=8, n_embd=32, n_head=2, n_positions=16, vocab_size=VOCAB,
                      bos_token_id=0, eos_token_id=0)
    resident = member(0, "sgd", None, name="resident")
    spilled = dataclasses.replace(member(1, "adamw", 1.0, name="spilled"), model=deep)
    fused = [member(2 + k, "sgd", 1.0, name=f"fused{k}") for k in range(2)]
    spilled_fused = [dataclasses.replace(member(4 + k, "adamw", None, name=f"deep{k}"),
                                         model=deep) for k in range(2)]
    with ShardExecutor(f"cpu:{num_devices}x{budget}") as executor:
        assert not executor.will_spill(resident) and not executor.will_spill(fused[0])
        assert len(executor.plan(spilled).shards) >= 2
        assert len(executor.stacked_plan(spilled_fused[0], 2).shards) >= 2
        with executor._state.condition:  # every job is the policy's before any task starts
            futures = {resident.name: executor.submit(resident),
                       spilled.name: executor.submit(spilled)}
            for array in (fused, spilled_fused):
                futures.update(zip([s.name for s in array], executor.submit_fused(array),
                                   strict=True))
        results = {name: future.result(timeout=600) for name, future in futures.items()}
        devices = executor.devices
    for spec in [resident, spilled, *fused, *spilled_fused]:
        result = results[spec.name]
        diff = max_abs_diff(result.state_dict, plain(spec).state_dict)
        print(f"{num_devices} device(s) {spec.name}: max abs weight diff {diff:.3g}")
        assert diff <= tolerance(spec)
        assert result.peak_device_bytes is not None and result.peak_device_bytes <= budget
    assert results["spilled"].swap_bytes > 0 and results["deep0"].swap_bytes > 0
    assert all(device.meter.live_bytes == 0 for device in devices)


def masked(spec: TrainSpec, **overrides) -> TrainSpec:
    return dataclasses.replace(spec, train_mask=TRAIN_MASK, eval_mask=EVAL_MASK, **overrides)


def test_plains_masked_loss_is_transformers_loss_with_ignored_labels() -> None:
    """train_plain's first step loss and its evaluation equal GPT2LMHeadModel(labels=...) with
    -100 where the mask is false (the mean over counted tokens), and the mask matters."""
    from transformers import GPT2LMHeadModel

    spec = masked(member(0, "sgd", None), max_steps=1, eval_every=None)
    result = train_plain(spec, CPU)
    torch.manual_seed(spec.seed)
    model = GPT2LMHeadModel(config()).eval()
    labels = EVAL.masked_fill(~EVAL_MASK, -100)
    with torch.no_grad():
        want = model(input_ids=EVAL, labels=labels).loss.item()
        unmasked = model(input_ids=EVAL, labels=EVAL).loss.item()
    assert result.history("eval_loss")[0] == (0, pytest.approx(want, rel=1e-6))
    assert abs(want - unmasked) > 1e-3


#: Masked jobs per path: (members K, device budget, LoRA adapter, pipelined over two devices);
#: a budget below ONE_SHARD spills the job.
MASKED_PATHS = {
    "resident": (1, ONE_SHARD, False, False),
    "spilled": (1, THREE_SHARDS["adamw", 1], False, False),
    "fused": (3, ONE_SHARD, False, False),
    "fused-spilled": (3, THREE_SHARDS["adamw", 3], False, False),
    "lora": (1, ONE_SHARD, True, False),
    "lora-spilled": (1, 100 * KiB, True, False),
    "lora-fused": (3, ONE_SHARD, True, False),
    "pipelined": (1, THREE_SHARDS["adamw", 1], False, True),
}


@pytest.mark.parametrize("plan_activations", [True, False], ids=["memory-plan", "recompute"])
@pytest.mark.parametrize("path", list(MASKED_PATHS))
def test_masked_batches_train_as_plain_in_every_path(path: str, plan_activations: bool) -> None:
    """Microbatches of 2 blocks: each weighs in by its share of the step's counted tokens."""
    num_members, budget, lora, pipelined = MASKED_PATHS[path]
    peft = LoraSpec(r=4, alpha=8.0, dropout=0.1) if lora else None
    shared = {"seed": 11} if lora else {}  # LoRA members share one base, drawn from the seed
    specs = [masked(member(k, "adamw", 1.0), peft=peft, **shared) for k in range(num_members)]
    with ShardExecutor(f"cpu:1x{budget}", spill="always", microbatch_size=2,
                  plan_activations=plan_activations) as executor:
        plan = executor.plan(specs[0]) if num_members == 1 else \
            executor.stacked_plan(specs[0], num_members)
        assert (len(plan.shards) > 1) == (budget < ONE_SHARD)
        assert plan.shards[-1].microbatch_size == 2
        if pipelined:
            pool = [VirtualDevice(f"cpu:{i}", budget_bytes=2 * budget) for i in range(2)]
            results = [train_pipelined(specs[0], pool, plan, (0, 1, len(plan.shards)))]
            assert results[0].p2p_bytes > 0
        else:
            futures = executor.submit_fused(specs)
            results = [future.result() for future in futures]
    for spec, result in zip(specs, results, strict=True):
        expected = plain(spec)
        diff = max_abs_diff(result.state_dict, expected.state_dict)
        print(f"{path} {spec.name}: max abs weight diff {diff:.3g}")
        assert diff <= tolerance(spec)
        for metric in ("train_loss", "eval_loss"):
            assert_same_history(result, expected, metric, rel=1e-5)
    unmasked = plain(dataclasses.replace(specs[0], train_mask=None, eval_mask=None))
    assert max_abs_diff(unmasked.state_dict, plain(specs[0]).state_dict) > \
        10 * tolerance(specs[0])
