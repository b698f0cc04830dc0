"""``sweepmaster plan``: how each job of a sweep would train, without training."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from sweepmaster.cli.console import console, guarded
from sweepmaster.cli.options import (
    DeviceMemoryOption,
    DevicesOption,
    SetOption,
    StorageOption,
    sweep_file_argument,
)
from sweepmaster.cli.plan_tables import (
    fusion_line,
    jobs_table,
    pipeline_table,
    print_memory_plan,
    shards_table,
    update_line,
)


def plan(
    sweep_file: Annotated[Path, sweep_file_argument("plan")],
    devices: DevicesOption = None,
    device_memory: DeviceMemoryOption = None,
    storage: StorageOption = None,
    overrides: SetOption = None,
    measure_fusion: Annotated[bool, typer.Option(
        "--measure-fusion", help="With resources.fusion: auto, measure the fusion degrees the "
        "cache lacks (trains a few steps of K = 1, 2, 4, ... models on a device).")] = False,
) -> None:
    """Print how each job of a sweep would train, without training anything.

    Per job: spilled or plain, its shards with their bytes and estimated times, shard tasks and
    swap volume per step, its plain footprint against the device budget, and for a spilled job
    where its optimizer steps run (device, or host: ZeRO-Offload) with the bytes each moves,
    which activations each shard keeps, swaps to the host or recomputes, and on several devices
    how it pipelines when runnable jobs are fewer than devices (packs per device, host and p2p
    bytes per step; whether resources.pipeline turns it on). A job
    is a set of trials sharing one architecture (model, dtype, batch and block size, optimizer
    kind). Plans are read from the storage's partition cache when its database exists; plan
    never creates or changes a database (launch keeps the new plans). With resources.fusion
    on, each job's fusion degree K (auto: from the storage's fusion cache, else "not
    measured" unless --measure-fusion) and, for a grid, the fused arrays its trials form; for
    trials that spill, each size of fused array's stacked shards and memory plan.
    """
    from sweepmaster.config.schema import load_sweep_config
    from sweepmaster.config.value_checks import check_storage_option
    from sweepmaster.sweep.plan import plan_sweep

    guarded(lambda: check_storage_option(storage))
    config = guarded(lambda: load_sweep_config(sweep_file, overrides or ()))
    config = guarded(lambda: config.with_resources(devices, device_memory))
    with console.status("planning (profiling each architecture once"
                        + (", measuring fusion degrees)" if measure_fusion else ")")):
        sweep_plan = guarded(lambda: plan_sweep(config, devices=devices,
                                                 device_memory=device_memory, storage=storage,
                                                 measure_fusion=measure_fusion, read_only=True))
    console.print(f"sweep {sweep_plan.name}: {sweep_plan.num_jobs} job(s) from "
                  f"{sweep_plan.num_configs} configuration(s) on {', '.join(sweep_plan.devices)}",
                  highlight=False, markup=False)
    for note in sweep_plan.notes:
        console.print(f"  [dim]{escape(note)}[/]", highlight=False)
    console.print(jobs_table(sweep_plan))
    for job in sweep_plan.jobs:
        if job.fusion is not None:
            console.print(fusion_line(job), highlight=False, markup=False)
    for job in sweep_plan.jobs:
        if job.spill:
            console.print(shards_table(job))
            console.print(update_line(job), highlight=False, markup=False)
        if job.pipeline is not None and job.pipeline.layouts:
            if config.resources.pipeline == "off":
                console.print(f"job {job.number}: pipelining is off (resources.pipeline: off); "
                              "with auto:", highlight=False, markup=False)
            console.print(pipeline_table(job))
        elif job.pipeline is not None and job.pipeline.shape is not None and (
                job.pipeline.shape.packs or job.pipeline.shape.wrap):
            console.print(f"job {job.number}: never pipelines: no pack layout's step is "
                          "predicted as short as its step as shard tasks "
                          f"({job.pipeline.shard_step_s:.3g} s)", highlight=False, markup=False)
        elif job.pipeline is not None:
            console.print(f"job {job.number}: never pipelines: no two packs of its shards fit "
                          "a device's budget", highlight=False, markup=False)
        if job.spill:
            print_memory_plan(job)
        for array in job.fusion.arrays if job.fusion is not None else ():
            what = f"fused array of {array.num_members}"
            shown = dataclasses.replace(job, plan=array.stacked_plan,
                                        memory_plan=array.memory_plan)
            console.print(shards_table(shown, f"{what} (stacked shards)"))
            print_memory_plan(shown, what)
        if job.error is not None:
            console.print(f"[red]job {job.number} on {', '.join(job.devices)}:[/] "
                          f"{escape(str(job.error))}", highlight=False)
