"""The ``plan`` dry run as tables: jobs, shards, memory plans, pipelines, fusion."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from rich.console import Console, RenderableType
from rich.text import Text

from sweepmaster.cli.console import console, counted, format_size


def _ratio(num_bytes: int, budget_bytes: int) -> str:
    ratio = num_bytes / budget_bytes
    return f"{ratio:.1f}x" if ratio >= 1 else f"{ratio:.2f}x"


def _layers_text(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"


def _job_mode(job: Any) -> Text:
    if job.error is not None:
        return Text("too large", style="red")
    if job.plan is None:
        return Text("plain (host)")
    return Text("spills", style="yellow") if job.spill else Text("plain", style="green")


def jobs_table(sweep_plan: Any, out: Console | None = None) -> RenderableType:
    """The jobs of a :class:`~sweepmaster.sweep.plan.SweepPlan`: a row per job and device class."""
    from sweepmaster.cli.tables import TableColumn, cell, fitted_table

    jobs = sweep_plan.jobs
    spilled = [job.plan if job.spill else None for job in jobs]

    def column(header: str, priority: int, values: list[Any], justify: Any = "right",
               wrap: bool = False) -> TableColumn:
        return TableColumn(header, priority, justify, wrap,
                           [v if isinstance(v, Text) else cell(v) for v in values])

    columns = [
        column("job", 0, [job.number for job in jobs]),
        column("trials", 4, [len(job.configs) for job in jobs]),
    ]
    if any(job.params for job in jobs):
        columns.append(column("parameters", 1, [job.label for job in jobs], "left", wrap=True))
    if len({job.devices for job in jobs}) > 1:
        columns.append(column("devices", 2, [", ".join(job.devices) for job in jobs], "left",
                              wrap=True))
    columns += [
        column("mode", 0, [_job_mode(job) for job in jobs], "left"),
        column("shards", 1, [len(p.shards) if p else "" for p in spilled]),
        column("tasks/step", 5, [p.num_tasks_per_step if p else "" for p in spilled]),
        column("swap/step", 2, [format_size(p.swap_bytes_per_step) if p else ""
                                for p in spilled]),
        column("est. step", 3, [f"{p.step_s:.2f} s" if p else "" for p in spilled]),
        column("peak", 3, [format_size(p.peak_bytes) if p else "" for p in spilled]),
        column("update", 2, [p.update_on if p else "" for p in spilled], "left"),
        column("plain footprint", 2, [format_size(job.plain_bytes) for job in jobs]),
        column("budget", 4, [format_size(job.budget_bytes) for job in jobs]),
        column("footprint/budget", 1, [_ratio(job.plain_bytes, job.budget_bytes) for job in jobs]),
        column("plan", 6, ["" if job.plan is None else ("cached" if job.cached else "new")
                           for job in jobs], "left"),
    ]
    if sweep_plan.fusion != "off":
        columns.append(column("fusion", 1, [_fusion_cell(job.fusion) for job in jobs]))
    return fitted_table(out or console, columns, stack_rows=True)


def update_line(job: Any) -> str:
    """Where a spilled job's optimizer steps run, why, and the bytes each site moves a step.

    The device update promotes and demotes the shards' optimizer state and writes the changed
    parameters back; the host update (ZeRO-Offload) demotes the gradients and steps on the host.
    """
    cost = job.update
    line = (f"job {job.number}: updates on the {job.plan.update_on} ({cost.reason}); per step "
            f"the device update moves {format_size(cost.device_bytes)} (optimizer state up and "
            f"down, parameters back), the host update {format_size(cost.host_bytes)} "
            "(gradients home)")
    if cost.compared:
        line += f"; est. {cost.device_s:.3g} s against {cost.host_s:.3g} s"
    return line


def _fusion_cell(fusion: Any) -> str:
    """The fusion column of ``plan``: ``K=2``, ``K=? (auto)``, ``1 (spills)``."""
    if fusion is None or fusion.k is None:
        return "K=? (auto)"
    if fusion.source in ("spills", "unfusable"):
        return f"1 ({fusion.source})"
    return f"K={fusion.k}"


def fusion_line(job: Any) -> str:
    """One line per job for ``plan``: its fusion degree, why, and the fused arrays of a grid."""
    label = f" ({job.label})" if job.params else ""
    line = f"job {job.number}{label} fusion on {', '.join(job.devices)}: {job.fusion.note}"
    sizes = job.fusion.array_sizes
    arrays = [size for size in sizes if size > 1]
    if arrays:
        counts = sorted(collections.Counter(arrays).items(), reverse=True)
        shape = " and ".join(f"{n} of {size}" for size, n in counts)
        plural = "s" if len(arrays) > 1 else ""
        line += f"; its {sum(sizes)} trials form {len(arrays)} fused array{plural} " + (
            f"of {arrays[0]}" if len(counts) == 1 else f"({shape})")
        alone = len(sizes) - len(arrays)
        line += f", {alone} trial{'s' if alone > 1 else ''} train{'s' * (alone == 1)} alone" \
            if alone else ""
    return line


def memory_plan_table(job: Any, what: str = "",
                       out: Console | None = None) -> RenderableType:
    """The swap / recompute plan of one spilled job's activations (mu-TWO).

    ``what``: e.g. a fused array's, whose stacked shards and memory plan ``job`` then holds.
    """
    from sweepmaster.cli.tables import TableColumn, cell, fitted_table

    memory, plan = job.memory_plan, job.plan
    rows = memory.summary()
    label = f" ({what})" if what else ""
    title = (f"job {job.number}{label}: activations kept (K), swapped (S) or recomputed (R) per "
             f"layer; est. step {memory.step_s:.3f} s against {plan.step_s:.3f} s recomputing "
             f"all, {format_size(memory.swap_bytes_per_step)} swapped per step at "
             f"{memory.bandwidth / 2**30:.1f} GiB/s")
    specs: list[tuple[str, int, Callable[[Any], Any]]] = [
        ("shard", 0, lambda r: r.shard),
        ("layers", 2, lambda r: r.layers),
        ("decisions", 0, lambda r: r.decisions),
        ("kept", 1, lambda r: format_size(r.kept_bytes)),
        ("swapped", 1, lambda r: format_size(r.swapped_bytes)),
        ("recomputed", 2, lambda r: format_size(r.recomputed_bytes)),
        ("peak", 1, lambda r: format_size(r.peak_bytes)),
        ("overhead s", 3, lambda r: f"{r.overhead_s:.3f}"),
        ("recompute-all s", 4, lambda r: f"{r.full_recompute_s:.3f}"),
    ]
    columns = [TableColumn(name, priority,
                           "left" if name in ("layers", "decisions") else "right",
                           name == "decisions", [cell(get(r)) for r in rows])
               for name, priority, get in specs]
    return fitted_table(out or console, columns, title, stack_rows=True)


def print_memory_plan(job: Any, what: str = "") -> None:
    """Print a spilled job's memory plan (``what``: e.g. a fused array's), or that it has none."""
    if job.memory_plan is not None:
        console.print(memory_plan_table(job, what))
        return
    label = f" ({what})" if what else ""
    console.print(f"job {job.number}{label}: every activation is recomputed in the backward "
                  "tasks (Hydra): no keep / swap plan fits beside the shards' peaks",
                  highlight=False, markup=False)


def shards_table(job: Any, what: str = "",
                       out: Console | None = None) -> RenderableType:
    """The shards of one spilled job (``what``: e.g. a fused array's stacked shards).

    Gradients take the bytes of the trainable parameters, so they have no column of their own
    (params: trainable and frozen, e.g. a LoRA adapter and its base).
    """
    from sweepmaster.cli.tables import TableColumn, cell, fitted_table

    plan = job.plan
    label = f" ({job.label})" if job.params else ""
    label += f" {what}" if what else ""
    title = (f"job {job.number}{label}: {counted(len(plan.shards), 'shard')} on "
             f"{', '.join(job.devices)}, batch {plan.batch_size}, "
             f"{counted(plan.num_tasks_per_step, 'shard task')} and "
             f"{format_size(plan.swap_bytes_per_step)} swapped per step; gradients take the "
             "bytes of the trainable parameters")
    specs: list[tuple[str, int, Callable[[Any], Any]]] = [
        ("shard", 0, lambda s: s.index),
        ("layers", 1, lambda s: _layers_text(s.layer_names)),
        ("microbatch", 3, lambda s: s.microbatch_size),
        ("params", 2, lambda s: format_size(s.param_bytes)),
        ("optimizer", 3, lambda s: format_size(s.optimizer_bytes)),
        ("activations", 3, lambda s: format_size(s.activation_bytes)),
        ("fwd peak", 2, lambda s: format_size(s.forward_peak_bytes)
         if s.forward_peak_bytes else ""),
        ("bwd peak", 1, lambda s: format_size(s.backward_peak_bytes)),
        ("fwd s", 4, lambda s: f"{s.forward_s:.3f}" if s.forward_peak_bytes else ""),
        ("bwd s", 4, lambda s: f"{s.backward_s:.3f}"),
    ]
    columns = [TableColumn(name, priority, "left" if name == "layers" else "right",
                           name == "layers", [cell(get(s)) for s in plan.shards])
               for name, priority, get in specs]
    return fitted_table(out or console, columns, title, stack_rows=True)


def pipeline_table(job: Any, out: Console | None = None) -> RenderableType:
    """How one spilled job pipelines over several devices (Harmony PP), one row per layout."""
    from sweepmaster.cli.tables import TableColumn, cell, fitted_table

    pipeline, plan = job.pipeline, job.plan
    title = (f"job {job.number}: pipelines when runnable jobs are fewer than free devices, "
             f"{pipeline.num_microbatches} microbatches per step; spilled on one device: est. "
             f"{plan.step_s:.3f} s and {format_size(plan.swap_bytes_per_step)} swapped per step")

    def packs(layout: Any) -> str:
        return ", ".join(f"{device}: {_shards_text(pack)}"
                         for device, pack in zip(layout.devices, layout.packs, strict=True))

    specs: list[tuple[str, int, Callable[[Any], Any]]] = [
        ("runnable jobs", 0, lambda r: f"{r.runnable[0]}-{r.runnable[1]}"
         if r.runnable[0] < r.runnable[1] else r.runnable[0]),
        ("packs per device", 0, packs),
        ("est. step", 1, lambda r: f"{r.step_s:.3f} s"),
        ("host/step", 1, lambda r: format_size(r.host_bytes_per_step)),
        ("p2p/step", 1, lambda r: format_size(r.p2p_bytes_per_step)),
        ("host/step no p2p", 3, lambda r: format_size(r.host_bytes_per_step_without_p2p)),
        ("load", 2, lambda r: format_size(r.load_bytes)),
    ]
    columns = [TableColumn(name, priority, "left" if name == "packs per device" else "right",
                           name == "packs per device", [cell(get(r)) for r in pipeline.layouts])
               for name, priority, get in specs]
    return fitted_table(out or console, columns, title, stack_rows=True)


def _shards_text(pack: tuple[int, ...]) -> str:
    return f"shard {pack[0]}" if len(pack) == 1 else f"shards {pack[0]}-{pack[-1]}"


def job_line(job: Any) -> str:
    """One line per job for ``launch``: how it will train."""
    label = f" ({job.label})" if job.params else ""
    where = ", ".join(job.devices)
    ratio = f"{format_size(job.plain_bytes)}, {_ratio(job.plain_bytes, job.budget_bytes)} " \
        f"the {format_size(job.budget_bytes)} budget"
    if job.spill:
        plan = job.plan
        return (f"job {job.number}{label}: spills into {counted(len(plan.shards), 'shard')} on "
                f"{where} (plain footprint {ratio}); est. {plan.step_s:.2f} s and "
                f"{format_size(plan.swap_bytes_per_step)} swapped per step")
    return (f"job {job.number}{label}: trains as one resident shard on {where} "
            f"(footprint {ratio})")
