"""Copies a spilled step issues beyond plain training: one per flat buffer, not one per tensor.

Counted with ``torch.profiler`` on a virtual device: every ``aten::copy_`` (the kernel behind
``_foreach_copy_``, ``to``, ``clone``, ``contiguous``) that runs outside a compute operator (a
copy inside ``addmm`` or an optimizer's arithmetic is the same in plain training and not a
move), an operator that a ``TorchDispatchMode`` dispatches again (the meter's) counted once.

    python tests/runtime/devices/test_copy_count.py   # prints the count of the GPT-2 12 x 64 step
"""

from __future__ import annotations

import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile
from transformers import GPT2Config

from sweepmaster.runtime import SpilledJob, VirtualDevice, make_plan, plan_job, profile_model
from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.training.fused_spill import SpilledFusedJob
from sweepmaster.runtime.training.plain import build_optimizer
from sweepmaster.workload import OptimizerSpec, TrainSpec
from sweepmaster.workload.causal_lm import build_model, causal_lm_loss, lm_logits

VOCAB = 512
#: Operators that only copy: a copy under them is still a move.
COPY_OPS = {"aten::copy_", "aten::_foreach_copy_", "aten::_to_copy", "aten::to", "aten::clone",
            "aten::contiguous", "aten::_copy_from", "PythonDispatchMode"}


def gpt2_spec(n_layer: int = 12, n_embd: int = 64, max_steps: int = 3) -> TrainSpec:
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, n_positions=64,
                        vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    data = torch.randint(0, VOCAB, (16, 32), generator=torch.Generator().manual_seed(1))
    return TrainSpec(model=config, train_data=data, eval_data=None,
                     optimizer=OptimizerSpec(name="adamw", lr=1e-3, weight_decay=0.1),
                     batch_size=4, max_steps=max_steps, seed=0)


def _redispatched(event: FunctionEvent) -> bool:
    """Whether ``event`` is an operator a Python dispatch mode runs again (seen twice)."""
    parent = event.cpu_parent
    return (parent is not None and parent.name == "PythonDispatchMode"
            and parent.cpu_parent is not None and parent.cpu_parent.name == event.name)


def _in_compute(event: FunctionEvent) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name not in COPY_OPS and parent.name.startswith(("aten::", "autograd::")):
            return True
        parent = parent.cpu_parent
    return False


def count_copies(prof: profile) -> int:
    """The copies a profiled region ran outside compute operators (see the module doc)."""
    return sum(1 for event in prof.events()
               if event.name == "aten::copy_" and not _redispatched(event)
               and not _in_compute(event))


def spilled_step_copies(job: SpilledJob | SpilledFusedJob, device: Device) -> int:
    """Run the job's next step (its tasks, prefetching) under the profiler; its copies."""
    first = job.next_task()
    assert first is not None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while (task := job.next_task()) is not None and task.step == first.step:
            job.prefetch(job.peek_task(), device)
            job.run(task, device)
    return count_copies(prof)


def plain_step_copies(spec: TrainSpec) -> int:
    """One step of plain training (``train_plain``'s loop) under the profiler; its copies."""
    model = build_model(spec.model)
    model.train()
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad],
                                spec.optimizer)
    ids_BT = spec.train_data[: spec.batch_size]

    def step() -> None:
        causal_lm_loss(lm_logits(model, ids_BT), ids_BT).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state is made
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return count_copies(prof)


def extra_copies_per_shard(spec: TrainSpec) -> tuple[float, int, int, int]:
    """(spilled - plain) copies of a steady-state step per shard, at 1/4 of the footprint."""
    probe = VirtualDevice("cpu:probe", budget_bytes=1 << 40)
    device = VirtualDevice("cpu:0", budget_bytes=plan_job(spec, probe).plain_bytes // 4)
    plan = plan_job(spec, device)
    job = SpilledJob(spec, plan)
    spilled_step_copies(job, device)  # step 1 makes nothing new, but warms up
    spilled = spilled_step_copies(job, device)
    plain = plain_step_copies(spec)
    num_shards = len(plan.shards)
    return (spilled - plain) / num_shards, spilled, plain, num_shards


def test_a_spilled_step_copies_each_flat_buffer_once() -> None:
    spec = gpt2_spec()
    assert sum(1 for _ in build_model(spec.model).parameters()) == 148
    per_shard, spilled, plain, num_shards = extra_copies_per_shard(spec)
    assert num_shards > 2, "the budget spills the model"
    assert per_shard <= 12, (spilled, plain, num_shards)


def _promote_copies(job: SpilledJob | SpilledFusedJob, shard: int) -> tuple[int, int, int]:
    """Copies of a promote of ``shard``'s tensors, the host buffers they live in, tensors."""
    device = VirtualDevice("cpu:0", budget_bytes=1 << 30)
    hosts = [job.members.host_tensor(key) for key in job.members.shard_keys(shard)]
    copies = device.transfer.promote(hosts)
    for host, copy in zip(hosts, copies, strict=True):
        assert torch.equal(host, copy) and copy.shape == host.shape
    buffers = {host.untyped_storage().data_ptr() for host in hosts}
    assert len({copy.untyped_storage().data_ptr() for copy in copies}) == len(buffers)
    assert device.meter.live_bytes == sum(host.nbytes for host in hosts)
    return device.transfers.num_promotes, len(buffers), len(hosts)


def test_promoting_a_shard_is_one_copy_per_flat_buffer() -> None:
    spec = gpt2_spec(n_layer=4, n_embd=32)
    device = VirtualDevice("cpu:probe", budget_bytes=1 << 40)
    plan = make_plan(profile_model(spec), spec.optimizer, [0, 3, 6], device)  # 2 shards
    for job in (SpilledJob(spec, plan), SpilledFusedJob([spec, spec], plan)):
        copies, buffers, tensors = _promote_copies(job, 0)
        assert tensors > 20 and copies == buffers == 1, type(job)
        # the last shard: its own parameters, and the tied embedding of shard 0
        copies, buffers, tensors = _promote_copies(job, 1)
        assert tensors > 20 and copies == buffers == 2, type(job)
        for shard in (0, 1):  # the optimizer state: one buffer (AdamW's two moments)
            state = [container[key] for container, key in job.members.state_slots(shard)]
            target = VirtualDevice("cpu:1", budget_bytes=1 << 30)
            target.transfer.promote(state)
            assert len(state) > 20 and target.transfers.num_promotes == 1, type(job)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(extra_copies_per_shard(gpt2_spec()))
