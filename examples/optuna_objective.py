"""sweepmaster's executor inside a plain Optuna objective.

    python examples/optuna_objective.py [--trials 4] [--steps 40] [--jobs 1]

Tokenizes the WikiText-2 slice shipped in examples/data (cached after the first run), then lets
Optuna's TPE sampler tune a 2-layer GPT-2's learning rate and weight decay, with median pruning.
`study.optimize(..., n_jobs=K)` may call `executor.fit` from K threads: they share the devices.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import optuna
from transformers import GPT2Config

import sweepmaster
from sweepmaster.workload import find_splits, make_blocks, tokenize_files

DATA = Path(__file__).parent / "data"
BLOCK_SIZE = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--storage", default=None, help="e.g. sqlite:///objective.db")
    args = parser.parse_args()

    splits = find_splits(DATA / "wikitext-2-slice")
    tokenizer = DATA / "gpt2-tokenizer"
    train_blocks = make_blocks(tokenize_files([splits["train"]], tokenizer), BLOCK_SIZE)
    valid_blocks = make_blocks(
        tokenize_files([splits["valid"]], tokenizer, max_tokens=64 * BLOCK_SIZE), BLOCK_SIZE)
    executor = sweepmaster.Executor(devices="auto")

    def objective(trial: optuna.Trial) -> float:
        spec = sweepmaster.TrainSpec(
            model=GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=BLOCK_SIZE),
            train_data=train_blocks,
            eval_data=valid_blocks,
            optimizer=sweepmaster.OptimizerSpec(
                name="adamw",
                lr=trial.suggest_float("lr", 1e-4, 1e-2, log=True),
                weight_decay=trial.suggest_float("weight_decay", 0.0, 0.1),
                warmup_steps=5,
            ),
            batch_size=8,
            max_steps=args.steps,
            eval_every=10,
            seed=0,
            name=f"trial-{trial.number}",
        )
        result = executor.fit(spec, trial)  # raises optuna.TrialPruned when pruned
        print(f"trial {trial.number}: eval loss {result.objective:.4f} "
              f"after {result.steps} steps ({result.train_seconds:.1f} s)")
        return result.objective

    study = optuna.create_study(
        storage=args.storage,
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=10),
    )
    study.optimize(objective, n_trials=args.trials, n_jobs=args.jobs)
    print(f"best: trial {study.best_trial.number}, eval loss {study.best_value:.4f}, "
          f"params {study.best_params}")


if __name__ == "__main__":
    main()
