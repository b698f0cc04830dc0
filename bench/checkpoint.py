"""Cost of crash-safe training-state checkpoints, against the cost of the steps they protect.

    python bench/checkpoint.py [--repeats 3] [--steps 5]

For each model (the quickstart GPT-2 and GPT-2 small, both with AdamW), in one process run: the
wall time of one training step (median of ``--steps``), of writing one checkpoint (temp file,
fsync, rename; best of ``--repeats``) and of finding, verifying and loading it, and its size.
The overhead of ``checkpoint_every = N`` is ``save / (N * step)``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from harness import report
from transformers import GPT2Config
from transformers.utils import logging as transformers_logging

from sweepmaster.runtime.training.plain import build_optimizer
from sweepmaster.runtime.training.training_state import (
    TrainingState,
    capture_rng,
    job_key,
    load_latest,
    optimizer_state_by_name,
    save_checkpoint,
)
from sweepmaster.workload import OptimizerSpec, TrainSpec, build_model, causal_lm_loss, lm_logits

MODELS = {
    "quickstart (4x128, B=8, T=64)": (GPT2Config(n_layer=4, n_embd=128, n_head=4,
                                                 n_positions=64), 8, 64),
    "GPT-2 small (124M, B=8, T=128)": (GPT2Config(), 8, 128),
}


def measure(name: str, config: GPT2Config, batch: int, block: int, num_steps: int,
            repeats: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = build_model(config)
    model.train()
    optimizer = build_optimizer(model.parameters(), OptimizerSpec())
    data = torch.randint(0, config.vocab_size, (batch * (num_steps + 1), block))
    step_seconds = []
    for step in range(num_steps + 1):
        ids = data[step * batch:(step + 1) * batch]
        start = time.perf_counter()
        causal_lm_loss(lm_logits(model, ids), ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step allocates the optimizer state
            step_seconds.append(time.perf_counter() - start)
    spec = TrainSpec(model=config, train_data=data, batch_size=batch, max_steps=num_steps)
    key = job_key(spec)
    names = [name for name, _ in model.named_parameters()]
    state = TrainingState(step=num_steps, model=model.state_dict(),
                          optimizer=optimizer_state_by_name(optimizer, names),
                          rng=capture_rng(torch.device("cpu")))
    save_s, load_s, size = [], [], 0
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            path = save_checkpoint(tmp, state, key)
            save_s.append(time.perf_counter() - start)
            size = path.stat().st_size
            start = time.perf_counter()
            loaded = load_latest(tmp, key)
            load_s.append(time.perf_counter() - start)
            assert loaded is not None and loaded.step == num_steps
    step_s = statistics.median(step_seconds)
    return {"model": name, "MiB": size / 2**20, "step s": step_s, "save s": min(save_s),
            "verify+load s": min(load_s), "save / step": min(save_s) / step_s,
            "overhead every 100 steps": min(save_s) / (100 * step_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()
    rows = [measure(name, config, batch, block, args.steps, args.repeats)
            for name, (config, batch, block) in MODELS.items()]
    report("checkpoint", rows)


if __name__ == "__main__":
    main()
