"""sweepmaster's overhead over a plain Optuna objective with a plain PyTorch loop.

    python bench/overhead.py [--config examples/quickstart.yaml] [--max-steps N] [--repeats 2]

Both paths train the same grid (same model, data, steps, evaluations, seeds) into their own
SQLite database in one process run, alternating which goes first. The plain path is what a user
writes by hand: a GridSampler study, ``study.optimize``, a PyTorch loop reporting the eval loss.
The ratio sweepmaster / plain is the figure of merit (target <= 1.05).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

import optuna
import torch
from harness import report, timed
from optuna.samplers import GridSampler
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from sweepmaster.config import load_sweep_config
from sweepmaster.config.train_specs import TokenData, prepare_data, train_spec_from_config
from sweepmaster.sweep import run_sweep

ROOT = Path(__file__).resolve().parents[1]


def plain_objective(config, data: TokenData):  # noqa: ANN001, ANN201
    """The hand-written baseline: the trial's config trained by a plain PyTorch loop."""

    def objective(trial: optuna.Trial) -> float:
        for name, dist in config.search_space().items():
            trial._suggest(name, dist)
        cfg = config.with_params(trial.params)
        spec = train_spec_from_config(cfg, data)
        torch.manual_seed(cfg.train.seed)
        model = AutoModelForCausalLM.from_config(spec.model)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                weight_decay=cfg.train.weight_decay)
        total, warmup = spec.total_steps, cfg.train.warmup_steps

        def lr_lambda(step: int) -> float:
            if step < warmup:
                return step / warmup
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        gen = torch.Generator().manual_seed(cfg.train.seed)
        order = torch.randperm(data.train.shape[0], generator=gen)
        bs = cfg.train.batch_size

        def evaluate() -> float:
            model.eval()
            losses = []
            with torch.no_grad():
                for i in range(0, data.valid.shape[0], bs):
                    x = data.valid[i:i + bs]
                    losses.append(model(input_ids=x, labels=x).loss.item() * x.shape[0])
            model.train()
            return sum(losses) / data.valid.shape[0]

        value = evaluate()
        pos = 0
        for step in range(1, total + 1):
            if pos + bs > len(order):
                order, pos = torch.randperm(data.train.shape[0], generator=gen), 0
            x = data.train[order[pos:pos + bs]]
            pos += bs
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step % cfg.train.eval_every == 0 or step == total:
                value = evaluate()
                trial.report(value, step)
                if trial.should_prune():
                    raise optuna.TrialPruned()
        return value

    return objective


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "quickstart.yaml"))
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()

    config = load_sweep_config(args.config)
    if args.max_steps:
        config = config.model_copy(update={
            "train": config.train.model_copy(update={"max_steps": args.max_steps})})
    data = prepare_data(config)  # tokenize once (cached); both paths then read the cache
    num_trials = config.grid_size()
    times: dict[str, list[float]] = {"sweepmaster": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = ["sweepmaster", "plain"] if r % 2 == 0 else ["plain", "sweepmaster"]
            for path in order:
                url = f"sqlite:///{tmp}/{path}-{r}.db"
                if path == "sweepmaster":
                    out = config.model_copy(update={
                        "output": config.output.model_copy(update={"dir": Path(tmp) / "ckpt"})})
                    # the pre-launch checks are launch's start-up, not training overhead
                    seconds, _ = timed(lambda out=out, url=url: run_sweep(out, storage=url,
                                                                          preflight=False))
                else:
                    study = optuna.create_study(
                        storage=url, study_name=config.name, direction=config.study.direction,
                        sampler=GridSampler(config.grid_space(), seed=config.study.seed))
                    seconds, _ = timed(lambda study=study: study.optimize(
                        plain_objective(config, data), n_trials=num_trials))
                times[path].append(seconds)
                print(f"repeat {r}: {path} {seconds:.1f} s", flush=True)
    plain, ours = statistics.median(times["plain"]), statistics.median(times["sweepmaster"])
    rows = [
        {"path": "plain Optuna + PyTorch loop", "trials": num_trials, "wall_s": plain,
         "per_trial_s": plain / num_trials, "ratio": 1.0},
        {"path": "sweepmaster launch", "trials": num_trials, "wall_s": ours,
         "per_trial_s": ours / num_trials, "ratio": ours / plain},
    ]
    report("overhead", rows, repeats=args.repeats, all_times_s=times,
           steps_per_trial=config.train.max_steps)


if __name__ == "__main__":
    main()
