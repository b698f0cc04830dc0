"""A job's chain of shard tasks for the policy, from its plan (Hydra's SHARP).

The SHARP policy (:mod:`~sweepmaster.runtime.scheduling.scheduler`) sees a job as a chain of
:class:`~sweepmaster.runtime.scheduling.chains.TaskSpec` s, one minibatch after another:
:func:`shard_chain` derives it from the job's plan, with the seconds, bytes and planned peaks of
each task. The executor's jobs (:mod:`~sweepmaster.runtime.execution.jobs`,
:mod:`~sweepmaster.runtime.execution.fused_jobs`) give it to the policy, and a simulation of them
(:func:`~sweepmaster.runtime.scheduling.simulate.simulate`) schedules the same chain.
"""

from __future__ import annotations

from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.scheduling.chains import JobSpec, TaskKind, TaskSpec

__all__ = ["shard_chain"]


def shard_chain(
    job_id: str,
    plan: JobPlan,
    num_steps: int,
    *,
    first_step: int = 0,
    eval_rows: int = 0,
    eval_every: int | None = None,
    memory_plan: MemoryPlan | None = None,
    num_members: int = 1,
) -> JobSpec:
    """Hydra's chain of a job trained by the shard tasks of ``plan``, for ``num_steps`` steps.

    Forward of shards ``0..S-2``, then backward (and just-in-time update) of ``S-1..0`` per
    step, with the plan's estimated seconds, the bytes each task moves
    (:meth:`~sweepmaster.runtime.planning.plans.JobPlan.task_bytes`: the shard's parameters,
    and the optimizer state kept with them, promoted unless resident; what the shard keeps on
    the device when it stays for the job's next task, and what of that the task changed,
    written back when it leaves; every other byte promoted or demoted) and its planned peak
    (:meth:`~sweepmaster.runtime.planning.plans.JobPlan.task_peak_bytes`: the memory plan's
    for its training, an early fetch of activations included, the job plan's for an
    evaluation pass or the deferred updates it runs first; the residency cache's input, with
    the optimizer state kept beside it while its shard is resident): what
    :class:`SpilledRun` and a spilled fused array give the policy, and what a simulation of them
    (:func:`~sweepmaster.runtime.scheduling.simulate.simulate`) schedules.

    Args:
        job_id: The job's name.
        plan: Its plan.
        num_steps: Steps of the chain (at least 1).
        first_step: Steps done before (a resumed job).
        eval_rows: Blocks of the job's evaluation set (0: it does not evaluate).
        eval_every: Its evaluation period in steps (``None``: at step 0 and the end only). A
            periodic evaluation makes steps differ: the chain then lists every task.
        memory_plan: The job's keep / swap / recompute plan (mu-TWO): its tasks take its
            seconds and move the activations it swaps too; ``None``: Hydra's recompute of every
            activation.
        num_members: K of a fused array's stacked ``plan`` (:meth:`~sweepmaster.runtime.\
planning.plans.JobPlan.task_bytes`); 1: a single job.
    """
    shards = plan.shards
    last = len(shards) - 1
    # a training task's seconds: its memory plan's (recompute and stalls as planned), as the
    # job's own tasks say (``ShardTask.est_seconds``), else its plan's (Hydra's recompute)
    timed = shards if memory_plan is None else memory_plan.shards
    seconds = [s.forward_s for s in timed[:last]] + [timed[last].forward_s
                                                      + timed[last].backward_s]
    seconds += [s.backward_s for s in timed[last - 1 :: -1]] if last else []
    kinds: list[TaskKind] = ["forward"] * last
    kinds += ["step" if last == 0 else "backward"] * (last + 1)
    order = [i for _, i in plan.task_order()]
    per_step = len(order)
    # two head steps (the first updates make the optimizer state), a steady one and the last:
    # every step between moves what the steady one does
    periodic = eval_rows > 0 and eval_every is not None
    num_moved = num_steps if periodic else min(num_steps, 4)
    moved = plan.task_bytes(
        num_moved, first_step=first_step, eval_rows=eval_rows, eval_every=eval_every,
        activations=None if memory_plan is None else memory_plan.shards,
        limit_bytes=None if memory_plan is None else memory_plan.limit_bytes,
        num_members=num_members)
    activations = None if memory_plan is None else memory_plan.shards
    peaks = [plan.task_peak_bytes(kind, i, activations) for kind, i in plan.task_order()]
    evaluated = set()  # positions in ``moved`` whose task runs an evaluation pass first
    if eval_rows > 0 and first_step == 0:
        evaluated.add(0)
    if periodic:
        assert eval_every is not None
        evaluated.update((done - first_step) * per_step
                         for done in range(first_step + 1, first_step + num_steps)
                         if done % eval_every == 0)
    eval_peak = max(plan.eval_peak_bytes(i) for i in range(len(shards)))
    # the last task: the final evaluation, else the updates ``grad_clip`` deferred (none: S = 1)
    end_peak = eval_peak if eval_rows > 0 else max(
        [plan.task_peak_bytes("backward", i) for i in range(1, len(shards))]
        if plan.grad_clip else [], default=0)

    def peak(p: int) -> int:
        planned = peaks[p % per_step]
        if p in evaluated:
            planned = max(planned, eval_peak)
        if p == len(moved) - 1:
            planned = max(planned, end_peak)
        return planned

    def steps(k: int, stop: int) -> tuple[TaskSpec, ...]:
        first = k * per_step
        return tuple(
            TaskSpec(job_id, p, order[p % per_step], kinds[p % per_step],
                     seconds[p % per_step], b.shard_bytes, b.demote_bytes, b.promote_bytes,
                     peak(first + p), kept_bytes=b.kept_bytes,
                     write_back_bytes=b.write_back_bytes, state_bytes=b.state_bytes)
            for p, b in enumerate(moved[first : stop * per_step])
        )

    if periodic:  # every step listed (its bytes differ), one step's tasks as its shape
        return JobSpec(job_id, steps(0, 1), num_steps, head_tasks=steps(0, num_steps))
    if num_steps <= 3:
        return JobSpec(job_id, steps(0, 1), num_steps, head_tasks=steps(0, num_steps))
    return JobSpec(job_id, steps(2, 3), num_steps, head_tasks=steps(0, 2),
                   last_tasks=steps(3, 4))

