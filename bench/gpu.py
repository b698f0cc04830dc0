"""The GPU check: one command, one JSON and one markdown table of what a GPU does with sweepmaster.

    python bench/gpu.py [--device cuda:0] [--parts cuda_tests,spill,llama,fusion]
                        [--out bench/results] [--dry-run]

On one GPU it finishes in under 8 minutes (sizes below) and writes ``<out>/gpu.json`` and
``<out>/gpu.md``, a summary table against the targets first, then one table per part:

1. ``cuda_tests``: ``pytest -m cuda`` (the tests that need a GPU; skipped elsewhere): passed,
   failed, skipped.
2. ``spill``: a spilled vs a plain step of GPT-2 124M (12 x 768, vocabulary 50257, T = 512,
   B = 8) on the GPU capped at 1/4 and 1/8 of its plain footprint
   (:func:`spill.overhead`, the same code as ``bench/spill.py --device cuda:0``). Target:
   spilled / plain <= 1.5 at 4x.
3. ``llama``: a Llama-family model of about 1B parameters (random init from a ``LlamaConfig``:
   hidden 2048, 16 layers, MLP 5632, vocabulary 32000; bf16; no download) spilled on the GPU
   capped at 1/4 of its plain footprint, T = 2048, B = 8: 16k tokens per weight pass (each
   resident shard runs every microbatch of the step). Tokens/s over the steps after the first,
   and model FLOPs (6 x parameters x tokens) per second as a share of the GPU's dense bf16 peak
   (:data:`BF16_PEAK_FLOPS`). Target: >= 40%.
4. ``fusion``: K = 1, 2, 4, 8 trials as one fused array (one stacked shard holding it, as the
   executor trains an array that fits) against the same K trials one after another
   (``train_plain``), full fine-tuning (GPT-2 4 x 512) and LoRA (adapters of ranks 4-16 over a
   GPT-2 124M base): the functions of ``bench/fusion.py`` and ``bench/lora.py``. Target: fused
   K = 8 LoRA >= 3x the sequential trials/s.

Without CUDA, or with ``--dry-run``, every part runs at tiny sizes on the CPU (virtual devices
in place of a capped GPU; ``pytest -m cuda --collect-only`` in place of the run) in about a
minute, so the script is exercised where no GPU is (``tests/test_gpu_check.py``); its numbers
say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fusion import CONFIGS, fused_seconds, sequential_seconds
from fusion import make_specs as full_specs
from harness import RESULTS, machine, markdown_table
from lora import make_specs as lora_specs
from spill import StepClock, overhead
from transformers import LlamaConfig

from sweepmaster.runtime import CudaDevice, Device, VirtualDevice, plan_job, train_spilled
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.fused_shards import plan_stacked, stacked_spec
from sweepmaster.workload import OptimizerSpec, TrainSpec

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

#: Dense bf16 tensor-core peak (FLOP/s) by GPU name, from the vendor's data sheets (without
#: sparsity): H100 SXM and H200 989.4 TFLOPS, H100 PCIe 756 TFLOPS, A100 312 TFLOPS.
BF16_PEAK_FLOPS = (("H200", 989.4e12), ("H100 PCIe", 756e12), ("H100", 989.4e12),
                   ("A100", 312e12))


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each part runs: the GPU's sizes, or the dry run's."""

    spill: dict[str, int]
    llama: dict[str, int]
    llama_dtype: str
    full: dict[str, int]
    lora: dict[str, int]
    ks: tuple[int, ...]
    fusion_steps: int
    steps: int


GPU = Sizes(
    spill={"n_layer": 12, "n_embd": 768, "block": 512, "batch": 8, "vocab": 50257},
    llama={"hidden": 2048, "layers": 16, "mlp": 5632, "heads": 16, "vocab": 32000,
           "block": 2048, "batch": 8},
    llama_dtype="bfloat16",
    full={"n_layer": 4, "n_embd": 512, "n_head": 8, "vocab": 8192, "block_size": 256,
          "batch": 8},
    lora={"n_layer": 12, "n_embd": 768, "vocab": 8192, "block_size": 256, "batch": 8},
    ks=(1, 2, 4, 8), fusion_steps=10, steps=3,
)
DRY_RUN = Sizes(
    spill={"n_layer": 8, "n_embd": 32, "block": 32, "batch": 4, "vocab": 128},
    llama={"hidden": 64, "layers": 2, "mlp": 128, "heads": 4, "vocab": 500, "block": 64,
           "batch": 4},
    llama_dtype="float32",
    full=CONFIGS["tiny"],
    lora={"n_layer": 2, "n_embd": 32, "vocab": 500, "block_size": 32, "batch": 4},
    ks=(1, 2), fusion_steps=2, steps=1,
)


def bf16_peak_flops(name: str | None) -> float | None:
    """The dense bf16 peak of a GPU by its name (:data:`BF16_PEAK_FLOPS`); ``None`` if unknown."""
    for key, flops in BF16_PEAK_FLOPS:
        if name is not None and key in name:
            return flops
    return None


def cuda_tests(dry_run: bool, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """``pytest -m cuda``: counts of its summary line (collected only, in a dry run)."""
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
               "tests"]
    if dry_run:
        command.append("--collect-only")
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        output, code = str(err.stdout or ""), -1
    counts = {word: int(number) for number, word in re.findall(
        r"(\d+) (passed|failed|skipped|errors?)\b", output)}
    selected = re.search(r"(\d+)(?:/\d+)? tests? collected", output)
    failures = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return [{"command": " ".join(command[1:]), "exit_code": code, "dry_run": dry_run,
             "selected": int(selected.group(1)) if selected else None,
             "passed": counts.get("passed", 0), "failed": counts.get("failed", 0),
             "skipped": counts.get("skipped", 0),
             "errors": counts.get("error", 0) + counts.get("errors", 0),
             "seconds": time.perf_counter() - start, "failures": "; ".join(failures[:5])}]


def spill_rows(device_name: str, sizes: Sizes) -> list[dict[str, Any]]:
    """Spilled vs plain step at 4x and 8x the budget (``bench/spill.py``'s overhead)."""
    s = sizes.spill
    return overhead(sizes.steps, s["n_layer"], s["n_embd"], 1, device_name, s["block"],
                    s["batch"], s["vocab"])


def llama_spec(sizes: Sizes, steps: int) -> TrainSpec:
    """The Llama of ``sizes``, randomly initialized from its config (no download)."""
    s = sizes.llama
    config = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["mlp"],
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["heads"], vocab_size=s["vocab"],
                         max_position_embeddings=s["block"], tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, s["vocab"], (2 * s["batch"], s["block"]), generator=generator)
    return TrainSpec(model=config, train_data=blocks, batch_size=s["batch"], max_steps=steps,
                     seed=0, dtype=sizes.llama_dtype,  # type: ignore[arg-type]
                     optimizer=OptimizerSpec(name="adamw", lr=1e-4, weight_decay=0.1))


def llama_rows(device_name: str, sizes: Sizes) -> list[dict[str, Any]]:
    """The ~1B Llama spilled at 1/4 of its footprint: tokens/s and share of the bf16 peak."""
    spec = llama_spec(sizes, sizes.steps + 1)
    plain_bytes = plan_job(spec, VirtualDevice("cpu:probe", budget_bytes=1 << 50)).plain_bytes
    budget = plain_bytes // 4
    on_cuda = device_name.startswith("cuda")
    device: Device
    if on_cuda:
        device = CudaDevice(device_name, memory_cap_bytes=budget)
        torch.cuda.set_per_process_memory_fraction(device.cuda_budget.memory_fraction,
                                                   device.torch_device)
        budget = device.budget_bytes
    else:
        device = VirtualDevice("cpu:llama", budget_bytes=budget)
    plan = plan_job(spec, device)
    clock = StepClock()
    try:
        result = train_spilled(spec, device, plan, clock)
    finally:
        if on_cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, device.torch_device)
    step_s = statistics.median(clock.step_seconds())
    num_params = _num_params(spec)
    tokens_per_s = spec.tokens_per_step / step_s
    peak = bf16_peak_flops(torch.cuda.get_device_name(device.torch_device)) if on_cuda else None
    flops_per_s = 6 * num_params * tokens_per_s
    rows = plan.microbatch_size
    return [{
        "model": f"llama {sizes.llama['layers']}x{sizes.llama['hidden']}, "
                 f"V={sizes.llama['vocab']}, {sizes.llama_dtype}",
        "params_M": num_params / 1e6, "device": device_name,
        "plain_footprint_MiB": plain_bytes / MiB, "budget_MiB": budget / MiB,
        "shards": len(plan.shards), "microbatch": rows,
        "tokens_per_weight_pass": spec.tokens_per_step,
        "step_s": step_s, "tokens_per_s": tokens_per_s, "model_tflops": flops_per_s / 1e12,
        "bf16_peak_pct": None if peak is None else 100 * flops_per_s / peak,
        "peak_MiB": (result.peak_device_bytes or 0) / MiB,
    }]


def _num_params(spec: TrainSpec) -> int:
    """Parameters of the spec's model, counted on a fake build (no memory)."""
    from sweepmaster.runtime.planning.profile import profile_model

    profile = profile_model(spec)
    return profile.total_param_bytes // torch.tensor([], dtype=getattr(
        torch, spec.dtype)).element_size()


def whole_plan(specs: list[TrainSpec], device: Device) -> JobPlan:
    """One stacked shard holding the array, padded to its widest member (as the executor)."""
    return plan_stacked(stacked_spec(specs), len(specs), device, whole=True)


def fusion_rows(device_name: str, sizes: Sizes) -> list[dict[str, Any]]:
    """K trials fused vs one after another, full and LoRA (bench/fusion.py, bench/lora.py)."""
    device = Device(device_name)
    lora = argparse.Namespace(**sizes.lora, steps=sizes.fusion_steps)
    kinds: dict[str, Callable[[int], list[TrainSpec]]] = {
        "full": lambda k: full_specs(sizes.full, sizes.fusion_steps, k),
        "lora": lambda k: lora_specs(lora, k),
    }
    rows = []
    for kind, make in kinds.items():
        warmup = make(2)[:2]
        fused_seconds(warmup, device, whole_plan(warmup, device))  # first-call costs
        for k in sizes.ks:
            specs = make(k)
            sequential = sequential_seconds(specs, device)
            fused = fused_seconds(specs, device, whole_plan(specs, device))
            rows.append({"kind": kind, "k": k, "sequential_s": sequential, "fused_s": fused,
                         "sequential_trials_per_s": k / sequential,
                         "fused_trials_per_s": k / fused, "speedup": sequential / fused})
            print(rows[-1], flush=True)
    return rows


def summary(parts: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per target of the check: what was measured, the target, whether it was met."""
    rows: list[dict[str, Any]] = []
    for row in parts.get("cuda_tests", []):
        if row["dry_run"]:
            rows.append({"check": "pytest -m cuda", "measured": f"{row['selected']} collected "
                         "(dry run: not run)", "target": "all pass", "met": None})
            continue
        ran = (f"{row['passed']} passed, {row['failed']} failed, {row['errors']} errors, "
               f"{row['skipped']} skipped")
        rows.append({"check": "pytest -m cuda", "measured": ran, "target": "all pass",
                     "met": row["exit_code"] == 0 and row["passed"] > 0})
    for row in parts.get("spill", []):
        target = "<= 1.5x" if round(row["footprint_x"]) == 4 else ""
        rows.append({"check": f"spilled / plain step at {row['footprint_x']:.0f}x budget",
                     "measured": f"{row['overhead_x']:.2f}x", "target": target,
                     "met": row["overhead_x"] <= 1.5 if target else None})
    for row in parts.get("llama", []):
        pct = row["bf16_peak_pct"]
        rows.append({"check": f"~1B Llama at 1/4 footprint ({row['tokens_per_s']:.0f} tok/s)",
                     "measured": "n/a (no known GPU)" if pct is None else f"{pct:.1f}% of bf16",
                     "target": ">= 40% of bf16 peak", "met": None if pct is None else pct >= 40})
    for row in parts.get("fusion", []):
        if row["k"] == max(r["k"] for r in parts["fusion"]):
            target = ">= 3x" if row["kind"] == "lora" else ""
            rows.append({"check": f"fused K = {row['k']} {row['kind']} vs one after another",
                         "measured": f"{row['speedup']:.2f}x", "target": target,
                         "met": row["speedup"] >= 3 if target else None})
    return rows


PARTS: dict[str, Callable[[str, Sizes], list[dict[str, Any]]]] = {
    "spill": spill_rows, "llama": llama_rows, "fusion": fusion_rows,
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the check (see the module doc); returns what ``gpu.json`` holds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--parts", default="cuda_tests,spill,llama,fusion")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on the CPU (the default without CUDA)")
    args = parser.parse_args(argv)
    dry_run = args.dry_run or not torch.cuda.is_available()
    device_name = "cpu" if dry_run else args.device
    sizes = DRY_RUN if dry_run else GPU
    start = time.perf_counter()
    parts: dict[str, list[dict[str, Any]]] = {}
    seconds: dict[str, float] = {}
    for name in [p for p in args.parts.split(",") if p]:
        if name != "cuda_tests" and name not in PARTS:
            parser.error(f"--parts: unknown part {name!r}")
        began = time.perf_counter()
        parts[name] = cuda_tests(dry_run) if name == "cuda_tests" else PARTS[name](
            device_name, sizes)
        seconds[name] = time.perf_counter() - began
        print(f"{name}: {seconds[name]:.0f} s", flush=True)
    rows = summary(parts)
    if dry_run:  # tiny sizes on the CPU: no target applies
        rows = [{**row, "met": None} for row in rows]
    record = {"benchmark": "gpu", "command": " ".join(["python", "bench/gpu.py", *(
        argv if argv is not None else sys.argv[1:])]), "dry_run": dry_run,
        "device": device_name, "machine": machine(), "seconds": time.perf_counter() - start,
        "part_seconds": seconds, "summary": rows, "parts": parts}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(record, indent=2))
    title = "GPU check (dry run on the CPU: tiny sizes)" if dry_run else \
        f"GPU check on {record['machine']['cuda']}"
    tables = [f"# {title}", "", markdown_table(rows)]
    for name, part_rows in parts.items():
        tables += ["", f"## {name}", "", markdown_table(part_rows)]
    (args.out / "gpu.md").write_text("\n".join(tables) + "\n")
    print("\n".join(tables))
    print(f"\n{record['seconds']:.0f} s; wrote {args.out / 'gpu.json'} and {args.out / 'gpu.md'}")
    return record


if __name__ == "__main__":
    main()
