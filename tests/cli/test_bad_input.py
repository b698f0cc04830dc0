"""The bad-input catalogue: every way a user can hand `sweepmaster launch` something unusable.

Each case runs the real CLI (in-process through Typer's runner; one through a subprocess) and
must end with exit code 2, exactly one line on stderr naming the problem, and nothing written:
no database file created, no row added or changed in an existing database (Optuna's tables and
sweepmaster's alike), no checkpoint or token-cache directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
import torch
from typer.testing import CliRunner

from sweepmaster.cli import app
from sweepmaster.store import upgrade_to_head
from tests.kit.data import ROOT as REPO
from tests.kit.sweeps import DATA, tiny_sweep, write_sweep

#: A tiny Llama config (the tiny sweep's model is GPT-2).
#: Whether this machine has a GPU (``devices: auto`` then means it, not the host).
_HAS_GPU = torch.cuda.is_available()

_LLAMA = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 32,
          "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 32}


@dataclass
class Case:
    """One bad input: how to make it, and what the error line must contain."""

    id: str
    make: Callable[[Path, dict[str, Any]], list[str] | None]
    fragments: tuple[str, ...]
    names_file: bool = True  # the message starts with the sweep file's path
    postgres: bool = False
    env: dict[str, str] | None = None  # environment settings of the run
    launch_only: bool = False  # only building the model finds it, which launch alone does
    no_gpu: bool = False  # holds on a machine without a GPU only


def _edit(**sections: Any) -> Callable[[Path, dict[str, Any]], None]:
    """A case that changes sections of the tiny sweep (``None`` deletes a key)."""

    def make(tmp_path: Path, raw: dict[str, Any]) -> None:
        for name, value in sections.items():
            if isinstance(value, dict) and isinstance(raw.get(name), dict) \
                    and name != "parameters":
                raw[name].update(value)
                raw[name] = {k: v for k, v in raw[name].items() if v is not None}
            else:
                raw[name] = value

    return make


def _text(text: str) -> Callable[[Path, dict[str, Any]], list[str]]:
    def make(tmp_path: Path, raw: dict[str, Any]) -> list[str]:
        (tmp_path / "sweep.yaml").write_text(text)
        return [str(tmp_path / "sweep.yaml")]

    return make


def _bytes(data: bytes) -> Callable[[Path, dict[str, Any]], list[str]]:
    def make(tmp_path: Path, raw: dict[str, Any]) -> list[str]:
        (tmp_path / "sweep.yaml").write_bytes(data)
        return [str(tmp_path / "sweep.yaml")]

    return make


def _storage(url: Callable[[Path], str]) -> Callable[[Path, dict[str, Any]], None]:
    def make(tmp_path: Path, raw: dict[str, Any]) -> None:
        raw["storage"] = url(tmp_path)

    return make


def _missing_split(tmp_path: Path, raw: dict[str, Any]) -> None:
    wiki = tmp_path / "wiki"
    wiki.mkdir()
    shutil.copy(DATA / "wikitext-2-slice" / "wiki.train.tokens", wiki)
    raw["data"]["dir"] = str(wiki)


def _empty_train_file(tmp_path: Path, raw: dict[str, Any]) -> None:
    (tmp_path / "train.txt").write_text("")
    del raw["data"]["dir"]
    raw["data"]["train_files"] = [str(tmp_path / "train.txt")]


def _broken_tokenizer(tmp_path: Path, raw: dict[str, Any]) -> None:
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    raw["data"]["tokenizer"] = str(tmp_path / "tok")


def _train_text(data: bytes) -> Callable[[Path, dict[str, Any]], None]:
    """A case whose training text is ``data`` (the validation text is the shipped one)."""

    def make(tmp_path: Path, raw: dict[str, Any]) -> None:
        (tmp_path / "train.txt").write_bytes(data)
        del raw["data"]["dir"]
        raw["data"]["train_files"] = [str(tmp_path / "train.txt")]
        raw["data"]["valid_files"] = [str(DATA / "wikitext-2-slice" / "wiki.valid.tokens")]

    return make


def _train_path(path: Callable[[Path], Path]) -> Callable[[Path, dict[str, Any]], None]:
    """A case whose training file is ``path(tmp_path)`` (a directory, a FIFO, a device)."""

    def make(tmp_path: Path, raw: dict[str, Any]) -> None:
        del raw["data"]["dir"]
        raw["data"]["train_files"] = [str(path(tmp_path))]
        raw["data"]["valid_files"] = [str(DATA / "wikitext-2-slice" / "wiki.valid.tokens")]

    return make


def _fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "train.fifo")
    return tmp_path / "train.fifo"


def _split_is_a_fifo(tmp_path: Path, raw: dict[str, Any]) -> None:
    """A WikiText-2 directory whose valid split is a named pipe (a read would block)."""
    wiki = tmp_path / "wiki"
    wiki.mkdir()
    shutil.copy(DATA / "wikitext-2-slice" / "wiki.train.tokens", wiki)
    os.mkfifo(wiki / "wiki.valid.tokens")
    raw["data"]["dir"] = str(wiki)


def _dataset_at(path: Callable[[Path], Path],
                builder: bool = False) -> Callable[[Path, dict[str, Any]], None]:
    """A ``data.dataset`` case: ``path(tmp_path)`` as the dataset, or as the json builder's."""

    def make(tmp_path: Path, raw: dict[str, Any]) -> None:
        del raw["data"]["dir"]
        where = str(path(tmp_path))
        raw["data"].update({"dataset": "json", "data_files": {"train": where}} if builder
                           else {"dataset": where})
        raw["data"]["eval_fraction"] = 0.1

    return make


def _pretrained_of_another_family(tmp_path: Path, raw: dict[str, Any]) -> None:
    (tmp_path / "gptj").mkdir()
    (tmp_path / "gptj" / "config.json").write_text(
        '{"model_type": "gptj", "n_layer": 1, "n_embd": 32, "n_head": 2, "rotary_dim": 8}')
    raw["model"] = {"pretrained": str(tmp_path / "gptj")}


def _pretrained_with_unknown_activation(tmp_path: Path, raw: dict[str, Any]) -> None:
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(
        json.dumps({**_LLAMA, "vocab_size": 50257, "hidden_act": "swiglu"}))
    raw["model"] = {"pretrained": str(tmp_path / "llama")}


def _output_dir_is_a_file(tmp_path: Path, raw: dict[str, Any]) -> None:
    (tmp_path / "checkpoints").write_text("not a directory\n")


def _not_a_database(tmp_path: Path, raw: dict[str, Any]) -> None:
    (tmp_path / "sweep.db").write_text("these are my notes, not a database\n" * 200)


def _read_only_database(tmp_path: Path, raw: dict[str, Any]) -> None:
    """A sweep database, opened read-only (SQLite's ``mode=ro``)."""
    upgrade_to_head(raw["storage"])
    raw["storage"] = f"sqlite:///file:{tmp_path / 'sweep.db'}?mode=ro&uri=true"


def _newer_sweepmaster(url: str) -> None:
    upgrade_to_head(url)
    engine = sa.create_engine(url)
    with engine.begin() as connection:
        connection.execute(sa.text("UPDATE sweepmaster_alembic_version SET version_num = '9999'"))
    engine.dispose()


def _newer_sweepmaster_sqlite(tmp_path: Path, raw: dict[str, Any]) -> None:
    _newer_sweepmaster(raw["storage"])


def _newer_optuna(tmp_path: Path, raw: dict[str, Any]) -> None:
    optuna.create_study(storage=raw["storage"], study_name="someone-elses")
    engine = sa.create_engine(raw["storage"])
    with engine.begin() as connection:
        connection.execute(sa.text("UPDATE alembic_version SET version_num = 'v99.0.0.a'"))
    engine.dispose()


def _launched_with_other_config(tmp_path: Path, raw: dict[str, Any]) -> None:
    first = {**raw, "train": {**raw["train"], "max_steps": 1},
             "parameters": {"train.lr": {"values": [1e-2]}}}
    path = write_sweep(tmp_path, first, "first.yaml")
    result = CliRunner().invoke(app, ["launch", str(path)])
    assert result.exit_code == 0, result.output
    shutil.rmtree(tmp_path / "checkpoints")
    shutil.rmtree(tmp_path / "token-cache")


def _postgres(prepare: Callable[[str], None] | None = None,
              ) -> Callable[[Path, dict[str, Any]], None]:
    """A case on a fresh PostgreSQL schema (the ``postgres_url`` fixture's), prepared first."""

    def make(tmp_path: Path, raw: dict[str, Any]) -> None:
        raw["storage"] = raw["postgres_url"]
        if prepare is not None:
            prepare(raw["storage"])

    return make


def _pg_other_config(url: str) -> None:
    raw = tiny_sweep(Path("/nonexistent"), storage=url)
    del raw["data"]["cache_dir"]
    raw["output"] = {"save": "none"}
    raw["train"]["max_steps"] = 1
    raw["parameters"] = {"train.lr": {"values": [1e-2]}}
    from sweepmaster.config import parse_sweep_config
    from sweepmaster.store import create_store_engine, get_or_create_sweep
    from sweepmaster.study import open_study

    config = parse_sweep_config(raw)
    engine = create_store_engine(url)
    upgrade_to_head(engine)
    study, _ = open_study(config, url)
    get_or_create_sweep(engine, config.name, study.study_name, config.canonical_text())
    study.enqueue_trial({"train.lr": 1e-2})
    engine.dispose()


CASES = [
    # the file itself
    Case("missing-file", lambda p, raw: [str(p / "nope.yaml")], ("nope.yaml", "no such file")),
    Case("malformed-yaml", _text("name: tiny\ndata: [\n  dir: x\n"), ("invalid YAML at line",)),
    Case("tab-indented-yaml", _text("name: tiny\ndata:\n\tdir: x\n"), ("invalid YAML",)),
    Case("duplicate-section", _text("name: tiny\ntrain: {lr: 0.1}\ntrain: {lr: 0.2}\n"),
         ("invalid YAML at line 3:1", "duplicate key 'train' (first at line 2)")),
    Case("empty-file", _text(""), ("expected a mapping", "empty file")),
    Case("not-a-mapping", _text("- name: tiny\n"), ("expected a mapping", "got list")),
    Case("binary-file", _bytes(b"name: \xff\xfe\x00"), ("cannot read a YAML text file",)),
    Case("sweep-file-is-a-directory", lambda p, raw: [str(p)],
         ("a YAML text file, got", "is a directory, not a regular file")),
    Case("sweep-file-is-dev-null", lambda p, raw: [os.devnull],
         ("a YAML text file, got /dev/null is a character device",)),
    Case("sweep-file-of-millions-of-values", _text("values: [" + "1, " * 2_000_000 + "]\n"),
         ("a YAML file of at most 262144 bytes",)),
    # keys and types
    Case("unknown-section", _edit(trian={"lr": 1e-3}),
         ("trian: unknown key", "did you mean 'train'?")),
    Case("unknown-key", _edit(train={"l_r": 1e-3}),
         ("train.l_r: unknown key", "did you mean 'lr'?")),
    Case("wrong-type", _edit(train={"batch_size": "eight"}),
         ("train.batch_size: expected an integer >= 1", "got 'eight'")),
    Case("out-of-range", _edit(train={"lr": -1.0}), ("train.lr: expected a number > 0",)),
    Case("infinite-number", _edit(train={"lr": float("inf")}),
         ("train.lr: expected a finite number > 0, got inf",)),
    Case("markup-in-a-key", _edit(train={"[/]": 1}), ("train.[/]: unknown key",)),
    Case("bad-name", _edit(name="my sweep/1"), ("name: expected a string matching",)),
    Case("bad-model-field", _edit(model={"config": {"n_layers": 2}}),
         ("model.config.n_layers", "did you mean 'n_layer'?")),
    Case("block-longer-than-positions", _edit(data={"block_size": 64}),
         ("data.block_size: at most model.config.n_positions (32), got 64",)),
    Case("block-longer-than-llama-positions",
         _edit(model={"config": {"model_type": "llama", "num_hidden_layers": 1,
                                 "hidden_size": 32, "num_attention_heads": 2,
                                 "intermediate_size": 64, "max_position_embeddings": 16}}),
         ("data.block_size: at most model.config.max_position_embeddings (16), got 32",)),
    Case("bad-set", lambda p, raw: ["--set", "train.lr"], ("--set: expected KEY=VALUE",)),
    Case("set-unknown-key", lambda p, raw: ["--set", "train.lrr=1e-3"],
         ("train.lrr: unknown key", "did you mean 'lr'?")),
    # sampler, pruner, search space
    Case("unknown-sampler", _edit(study={"sampler": "tpee"}),
         ("study.sampler.type", "got 'tpee'", "did you mean 'tpe'?")),
    Case("unknown-pruner", _edit(study={"pruner": "medain"}),
         ("study.pruner.type", "did you mean 'median'?")),
    Case("unknown-sampler-keyword",
         _edit(study={"sampler": {"type": "tpe", "n_startup_trial": 3}, "n_trials": 4}),
         ("study.sampler.n_startup_trial", "did you mean 'n_startup_trials'?")),
    Case("bad-pruner-value", _edit(study={"pruner": {"type": "median", "n_startup_trials": -1}}),
         ("study.pruner:", "MedianPruner", "n_startup_trials=-1")),
    Case("tpe-without-n-trials", _edit(study={"sampler": "tpe"}),
         ("study.n_trials: required with the tpe sampler",)),
    Case("grid-over-a-continuous-range",
         _edit(parameters={"train.lr": {"min": 1e-4, "max": 1e-2,
                                        "distribution": "log_uniform_values"}}),
         ("parameters.train.lr: a grid needs `values`", "log_uniform_values")),
    Case("unknown-parameter-path", _edit(parameters={"train.lrr": {"values": [1, 2]}}),
         ("parameters.train.lrr", "did you mean 'train.lr'?")),
    Case("bad-distribution", _edit(parameters={"train.lr": {"min": 1, "max": 2,
                                                            "distribution": "uniformm"}}),
         ("parameters.train.lr.distribution", "did you mean 'uniform'?")),
    Case("parameter-value-breaks-schema", _edit(parameters={"train.batch_size":
                                                            {"values": [4, 0]}}),
         ("parameters.train.batch_size", ">= 1")),
    # data and tokenizer
    Case("missing-data-dir", _edit(data={"dir": "/nonexistent/wikitext-2"}),
         ("data.dir: an existing directory", "/nonexistent/wikitext-2")),
    Case("missing-valid-split", _missing_split, ("data.dir", "missing valid split")),
    Case("empty-train-file", _empty_train_file,
         ("data.train_files: readable, non-empty text files", "empty file")),
    Case("missing-train-file", _edit(data={"dir": None, "train_files": ["/nonexistent.txt"]}),
         ("data.train_files", "no such file: /nonexistent.txt")),
    Case("missing-tokenizer", _edit(data={"tokenizer": "/nonexistent/tok"}),
         ("data.tokenizer", "/nonexistent/tok", "no such directory")),
    Case("broken-tokenizer", _broken_tokenizer,
         ("data.tokenizer: a loadable tokenizer directory",)),
    Case("missing-pretrained-model", _edit(model={"config": None, "pretrained": "./no-model"}),
         ("model.pretrained: a model directory saved with save_pretrained or a HuggingFace hub "
          "id, got ./no-model (no such directory, and not a HuggingFace hub id)",)),
    Case("pretrained-name-not-cached", _edit(model={"config": None, "pretrained": "gpt2"}),
         ("model.pretrained: a model directory saved with save_pretrained or a HuggingFace hub "
          "id, got gpt2 (no such directory, and not in the HuggingFace cache",
          "HF_HUB_OFFLINE is set"),
         env={"HF_HOME": "/nonexistent/hf-home", "HF_HUB_OFFLINE": "1"}),
    Case("unsupported-model-family",
         _edit(model={"config": {"model_type": "gptj", "n_layer": 1, "n_embd": 32, "n_head": 2,
                                 "n_positions": 32, "rotary_dim": 8}}),
         ("model.config.model_type: a causal LM family sweepmaster can split into layers "
          "(gpt2, gpt_neox, llama, mistral, opt, qwen2), got 'gptj'",)),
    Case("misspelled-model-type", _edit(model={"config": {"model_type": "gpt3"}}),
         ("model.config.model_type: a causal LM family sweepmaster can split into layers "
          "(gpt2, gpt_neox, llama, mistral, opt, qwen2), got 'gpt3'; did you mean 'gpt2'?",)),
    Case("field-of-another-family",
         _edit(model={"config": {"model_type": "llama", "n_layer": 2}}),
         ("model.config.n_layer: unknown key (not a field of LlamaConfig)",)),
    Case("pretrained-model-of-an-unsupported-family", _pretrained_of_another_family,
         ("model.pretrained: model.pretrained (", "gptj's config.json) model_type: a causal LM "
          "family sweepmaster can split into layers (gpt2, ", "got 'gptj'")),
    # what only shows when the model config is built or the data are read
    Case("heads-not-dividing-width",
         _edit(model={"config": {"n_layer": 1, "n_embd": 30, "n_head": 4, "n_positions": 32}}),
         ("model.config.n_head: expected a divisor of n_embd (30)", "got 4")),
    Case("negative-size",
         _edit(model={"config": {"n_layer": -1, "n_embd": 32, "n_head": 2, "n_positions": 32}}),
         ("model.config.n_layer: expected an integer >= 1, got -1",)),
    Case("vocabulary-smaller-than-tokenizer",
         _edit(model={"config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32,
                                 "vocab_size": 100}}),
         ("model.config.vocab_size: expected at least the 50257 tokens of the tokenizer",
          "got 100")),
    Case("model-config-field-of-wrong-type",
         _edit(model={"config": {"n_layer": "four", "n_embd": 32, "n_head": 2,
                                 "n_positions": 32}}),
         ("model.config.n_layer: expected int, got str (value: 'four')",)),
    Case("dropout-above-one",
         _edit(model={"config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32,
                                 "attn_pdrop": 2.0}}),
         ("model.config.attn_pdrop: expected a probability in [0, 1], got 2.0",)),
    Case("model-class-rejects-the-config",
         _edit(model={"config": {**_LLAMA, "rope_parameters": {"rope_type": "linear",
                                                               "rope_theta": 10000.0,
                                                               "factor": "x"}}}),
         ("model.config: a config transformers can build a causal LM from, got TypeError: "
          "unsupported operand type(s)",), launch_only=True),
    Case("unknown-activation",
         _edit(model={"config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32,
                                 "activation_function": "gelu_neww"}}),
         ("model.config.activation_function: expected an activation transformers knows (gelu, ",
          "got 'gelu_neww'; did you mean 'gelu_new'?")),
    Case("unknown-activation-in-one-grid-cell",
         _edit(parameters={"model.config.activation_function": {"values": ["relu", "swiglu"]}}),
         ("parameters.model.config.activation_function: with "
          "model.config.activation_function='swiglu': model.config.activation_function: "
          "expected an activation transformers knows (",)),
    Case("unknown-activation-of-a-pretrained-model", _pretrained_with_unknown_activation,
         ("model.pretrained: model.pretrained (", "config.json) hidden_act: expected an "
          "activation transformers knows (", "got 'swiglu'")),
    Case("unknown-rope-type",
         _edit(model={"config": {**_LLAMA, "rope_parameters": {"rope_type": "yarm",
                                                               "rope_theta": 10000.0}}}),
         ("model.config.rope_parameters.rope_type: expected a RoPE type transformers knows "
          "(default, dynamic, ", "got 'yarm'; did you mean 'yarn'?")),
    Case("heads-not-dividing-width-of-llama",
         _edit(model={"config": {**_LLAMA, "hidden_size": 30, "num_attention_heads": 4}}),
         ("model.config: a config LlamaConfig accepts, got: The hidden size (30) is not a "
          "multiple of the number of attention heads (4).",)),
    # LoRA adapters (model.peft)
    Case("lora-rank-zero", _edit(model={"peft": {"r": 0}}),
         ("model.peft.r: expected an integer >= 1, got 0",)),
    Case("lora-alpha-not-positive", _edit(model={"peft": {"alpha": -8}}),
         ("model.peft.alpha: expected a number > 0, got -8",)),
    Case("lora-dropout-of-one", _edit(model={"peft": {"dropout": 1.0}}),
         ("model.peft.dropout: expected a number >= 0 and < 1, got 1.0",)),
    Case("peft-type-not-lora", _edit(model={"peft": {"type": "ia3"}}),
         ("model.peft.type: expected one of 'lora', got 'ia3'",)),
    Case("lora-rank-zero-in-one-grid-cell", _edit(parameters={"model.peft.r": {"values": [4, 0]}}),
         ("parameters.model.peft.r: expected an integer >= 1, got 0",)),
    Case("lora-targets-matching-nothing",
         _edit(model={"peft": {"target_modules": ["q_proj", "v_proj"]}}),
         ("model.peft.target_modules: names of modules of GPT2LMHeadModel to adapt (its linear "
          "layers: c_attn, c_fc, c_proj, lm_head), got ['q_proj', 'v_proj']",)),
    Case("lora-targets-of-another-family",
         _edit(model={"config": _LLAMA, "peft": {"target_modules": ["c_attn"]}}),
         ("model.peft.target_modules: names of modules of LlamaForCausalLM to adapt (its linear "
          "layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj), got "
          "['c_attn']",)),
    Case("lora-targets-with-an-empty-name", _edit(model={"peft": {"target_modules": "c_attn,"}}),
         ("model.peft.target_modules: expected module names: a list, or one string of names "
          "separated by commas (e.g. 'c_attn,c_proj'), got 'c_attn,'",)),
    Case("lora-targets-matching-nothing-in-one-grid-cell",
         _edit(model={"peft": {"r": 2}},
               parameters={"model.peft.target_modules": {"values": ["c_attn", "q_proj,v_proj"]}}),
         ("parameters.model.peft.target_modules: with model.peft.target_modules='q_proj,v_proj': "
          "model.peft.target_modules: names of modules of GPT2LMHeadModel to adapt (its linear "
          "layers: c_attn, c_fc, c_proj, lm_head), got ['q_proj', 'v_proj']",)),
    Case("lora-targets-past-the-last-layer",
         _edit(model={"peft": {"target_modules": ["h.1.attn.c_attn"]}}),
         ("model.peft.target_modules: names of modules of GPT2LMHeadModel",
          "got ['h.1.attn.c_attn']")),
    Case("heads-not-dividing-width-in-one-grid-cell",
         _edit(parameters={"model.config.n_head": {"values": [2, 3]}}),
         ("parameters.model.config.n_head: with model.config.n_head=3: model.config.n_head: "
          "expected a divisor of n_embd (32)",)),
    Case("heads-not-dividing-width-at-a-range-bound",
         _edit(study={"sampler": "random", "n_trials": 2},
               parameters={"model.config.n_head": {"min": 2, "max": 3}}),
         ("parameters.model.config.n_head: with model.config.n_head=3",)),
    Case("batch-larger-than-the-data",
         _edit(data={"max_train_tokens": 70}, parameters={"train.batch_size": {"values": [4, 2]}}),
         ("parameters.train.batch_size: with train.batch_size=4: train.batch_size: at most the "
          "2 blocks of 32 tokens the training data hold (data.max_train_tokens: 70), got 4",)),
    Case("train-file-not-utf8", _train_text("naïve text\n".encode("latin-1") * 50),
         ("data.train_files: UTF-8 text files", "not UTF-8: byte 0xef at offset 2")),
    Case("train-text-shorter-than-a-block", _train_text(b" a few words\n"),
         ("data.train_files: text of at least one block of 32 tokens (data.block_size)",
          "got 4 tokens")),
    Case("token-cap-below-a-block", _edit(data={"max_train_tokens": 20}),
         ("data.max_train_tokens: at least one block of 32 tokens (data.block_size), got 20",)),
    # paths and names
    Case("output-dir-is-a-file", _output_dir_is_a_file,
         ("output.dir: a directory, got a file", "checkpoints")),
    Case("name-too-long-for-a-directory", _edit(name="s" * 300),
         ("name: expected a name of at most 200 characters",)),
    # devices and environment
    Case("device-size-without-unit", _edit(resources={"devices": "cpu:2x512"}),
         ("resources.devices:", "the size 512 has no unit")),
    Case("devices-option-size-without-unit", lambda p, raw: ["--devices", "cpu:1x512"],
         ("--devices: expected a device spec", "the size 512 has no unit"), names_file=False),
    Case("device-memory-without-unit", _edit(resources={"device_memory": 8}),
         ("resources.device_memory: expected a positive size with a unit B, KiB, MiB, GiB or "
          "TiB, e.g. 8GiB (the size 8 has no unit; write 8MiB, 8GiB or 8B), got 8",)),
    Case("device-memory-option-without-unit", lambda p, raw: ["--device-memory", "8"],
         ("--device-memory: expected a positive size with a unit", "the size 8 has no unit",
          "got '8'"), names_file=False),
    Case("bad-environment-setting", _edit(), ("SWEEPMASTER_STORAGE_RETRY_S: expected a number "
                                              "of seconds >= 0, got 'soon'",),
         names_file=False, env={"SWEEPMASTER_STORAGE_RETRY_S": "soon"}),
    Case("misspelled-environment-setting", _edit(), (
        "environment variable SWEEPMASTER_STORAGE_RETRY: not a sweepmaster setting (did you "
        "mean SWEEPMASTER_STORAGE_RETRY_S? known: SWEEPMASTER_DASHBOARD_TOKEN,",),
         names_file=False, env={"SWEEPMASTER_STORAGE_RETRY": "5"}),
    # sizes and counts beyond what the store or the machine holds
    Case("device-memory-beyond-64-bits", _edit(resources={"device_memory": "99999999TiB"}),
         ("resources.device_memory: expected a positive size", "at most 8 EiB",
          "got '99999999TiB'")),
    Case("device-memory-option-beyond-64-bits", lambda p, raw: ["--device-memory", "9" * 30 + "B"],
         ("--device-memory: expected a positive size", "at most 8 EiB"), names_file=False),
    Case("virtual-device-size-beyond-64-bits", _edit(resources={"devices": "cpu:1x99999999TiB"}),
         ("resources.devices: expected a device spec", "larger than 9223372036854775807")),
    Case("too-many-virtual-devices", _edit(resources={"devices": "cpu:100000x1MiB"}),
         ("resources.devices:", "cpu:100000x1mib asks for 100000 devices, more than 256")),
    Case("too-many-devices-option", lambda p, raw: ["--devices", ",".join(
        f"cpu:1x1MiB,cuda:{i}" for i in range(200))],
         ("--devices: expected a device spec", "more than 256 devices"), names_file=False),
    Case("virtual-devices-beyond-the-machine", _edit(resources={"devices": "cpu:2x1000000GiB"}),
         ("resources.devices: expected CPU devices of at most the machine's",
          "got 2000000.0 GiB (cpu:2x1000000GiB)")),
    Case("host-cap-beyond-the-machine",
         _edit(resources={"devices": "cpu", "device_memory": "1000000GiB"}),
         ("resources.device_memory: expected CPU devices of at most the machine's",)),
    Case("fusion-degree-beyond-any-device", _edit(resources={"fusion": 1000000000}),
         ("resources.fusion: expected auto, off or an integer >= 1 (the fusion degree K), at "
          "most 256",
          "got 1000000000")),
    Case("grid-range-of-too-many-values",
         _edit(parameters={"train.max_steps": {"min": 1, "max": 10**8}}),
         ("parameters.train.max_steps: a grid of at most 10000 values per parameter, got "
          "100000000",)),
    Case("grid-of-too-many-cells",
         _edit(parameters={f"train.{name}": {"min": 1, "max": 1000}
                           for name in ("max_steps", "warmup_steps", "eval_every")}),
         ("parameters: a grid of at most 1000000 configurations, got 1000000000",)),
    Case("epochs-past-the-step-column", _edit(train={"max_steps": None, "epochs": 1e12}),
         ("train.epochs: expected at most 2147483647 epochs", "got 1000000000000.0")),
    Case("n-trials-past-optuna-s-trial-numbers",
         _edit(study={"sampler": "random", "n_trials": 10**20}),
         ("study.n_trials: expected at most 2147483647 trials",)),
    Case("device-memory-past-the-host-of-auto-devices",
         _edit(resources={"devices": "auto", "device_memory": "100000GiB"}),
         ("resources.device_memory: expected CPU devices of at most the machine's",
          "(auto: the host, no GPU on this machine, device_memory 100000GiB)"), no_gpu=True),
    Case("device-memory-option-past-the-host-of-auto-devices",
         lambda p, raw: ["--device-memory", "100000GiB"],
         ("resources.device_memory: expected CPU devices of at most the machine's",),
         no_gpu=True, launch_only=True),
    Case("heartbeat-interval-past-any-wait",
         _edit(resources={"trial_heartbeat": {"interval_s": 10**12}}),
         ("resources.trial_heartbeat.interval_s: expected at most 2147483647",)),
    Case("a-billion-layers",
         _edit(model={"config": {"n_layer": 10**9, "n_embd": 32, "n_head": 2,
                                 "n_positions": 32}}),
         ("model.config.n_layer: expected an integer <= 10000", "got 1000000000")),
    Case("width-past-any-device",
         _edit(model={"config": {"n_layer": 1, "n_embd": 2**40, "n_head": 2,
                                 "n_positions": 32}}),
         ("model.config.n_embd: expected an integer <= 2147483647",)),
    Case("model-past-every-device",
         _edit(model={"config": {"n_layer": 1, "n_embd": 2**22, "n_head": 2,
                                 "n_positions": 32}}),
         ("layer 'embed' needs", "MiB to train, more than the device budget of"),
         launch_only=True),
    # settings that do nothing
    Case("lora-rank-swept-without-lora", _edit(parameters={"model.peft.r": {"values": [4, 8]}}),
         ("parameters.model.peft.r: model.peft to be set",)),
    Case("lora-constant-without-lora", _edit(parameters={"model.peft.alpha": {"value": 8}}),
         ("parameters.model.peft.alpha: model.peft to be set",)),
    Case("momentum-swept-under-adamw",
         _edit(parameters={"train.momentum": {"values": [0.0, 0.9]}}),
         ("parameters.train.momentum: train.optimizer: sgd", "got 'adamw'")),
    Case("epochs-swept-under-max-steps",
         _edit(parameters={"train.epochs": {"values": [1, 2]}}),
         ("parameters.train.epochs: train.max_steps: null (train.max_steps overrides "
          "train.epochs",)),
    Case("heartbeat-grace-period-without-heartbeat",
         _edit(resources={"trial_heartbeat": {"interval_s": None, "grace_period_s": 30}}),
         ("resources.trial_heartbeat.grace_period_s: null while interval_s is null",
          "got 30")),
    Case("duplicate-grid-value", _edit(parameters={"train.lr": {"values": [0.001, 0.001]}}),
         ("parameters.train.lr.values: choices that differ", "got 0.001 more than once")),
    Case("duplicate-grid-value-of-two-types",
         _edit(parameters={"train.batch_size": {"values": [2, 4, 2.0]}}),
         ("parameters.train.batch_size.values: choices that differ",)),
    Case("q-step-beyond-the-range",
         _edit(study={"sampler": "random", "n_trials": 2},
               parameters={"train.lr": {"min": 0, "max": 10, "q": 100}}),
         ("parameters.train.lr.q: a step of at most max - min (10)", "got 100")),
    Case("q-step-that-does-not-reach-max",
         _edit(study={"sampler": "random", "n_trials": 2},
               parameters={"train.warmup_steps": {"min": 0, "max": 10, "q": 3}}),
         ("parameters.train.warmup_steps.q: a step that divides max - min (10)",
          "got 3 (the range would end at 9, not 10)")),
    Case("infinite-range-bound",
         _edit(study={"sampler": "random", "n_trials": 2},
               parameters={"train.lr": {"min": 1e-4, "max": float("inf")}}),
         ("parameters.train.lr.max: a finite number, got inf",)),
    Case("headroom-below-zero", _edit(), (
        "environment variable SWEEPMASTER_DEVICE_HEADROOM: expected a fraction in [0, 1)",
        "got '-0.5'"), names_file=False, env={"SWEEPMASTER_DEVICE_HEADROOM": "-0.5"}),
    Case("headroom-above-one", _edit(), (
        "environment variable SWEEPMASTER_DEVICE_HEADROOM: expected a fraction in [0, 1)",
        "got '1.5'"), names_file=False, env={"SWEEPMASTER_DEVICE_HEADROOM": "1.5"}),
    Case("output-dir-under-proc", _edit(output={"dir": "/proc/sweeps"}),
         ("output.dir: a directory on a file system that keeps files, got /proc/sweeps",
          "a proc file system")),
    Case("output-dir-under-sys", _edit(output={"dir": "/sys/sweeps"}),
         ("output.dir: a directory on a file system that keeps files, got /sys/sweeps",
          "a sysfs file system")),
    # model settings that cannot train
    Case("float16-on-the-cpu", _edit(model={"dtype": "float16"}, resources={"devices": "cpu"}),
         ("model.dtype: float32 or bfloat16 (float16 weights train without loss scaling",
          "got 'float16'")),
    Case("float16-on-a-gpu", _edit(model={"dtype": "float16"}, resources={"devices": "cuda:0"}),
         ("model.dtype: float32 or bfloat16 (float16 weights train without loss scaling",
          "got 'float16'")),
    Case("float16-in-one-grid-cell-on-virtual-devices",
         _edit(parameters={"model.dtype": {"values": ["float32", "float16"]}},
               resources={"devices": "cpu:2x256MiB"}),
         ("parameters.model.dtype: float32 or bfloat16 (float16 weights",)),
    Case("negative-layer-norm-epsilon",
         _edit(model={"config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32,
                                 "layer_norm_epsilon": -1e-5}}),
         ("model.config.layer_norm_epsilon: expected a number > 0", "got -1e-05")),
    Case("zero-rms-norm-epsilon", _edit(model={"config": {**_LLAMA, "rms_norm_eps": 0.0}}),
         ("model.config.rms_norm_eps: expected a number > 0", "got 0.0")),
    Case("negative-initializer-range",
         _edit(model={"config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32,
                                 "initializer_range": -0.02}}),
         ("model.config.initializer_range: expected a number >= 0", "got -0.02")),
    Case("dropout-of-one",
         _edit(model={"config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32,
                                 "resid_pdrop": 1.0}}),
         ("model.config.resid_pdrop: expected a probability in [0, 1)", "got 1.0")),
    Case("infinite-model-setting",
         _edit(model={"config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32,
                                 "layer_norm_epsilon": float("inf")}}),
         ("model.config.layer_norm_epsilon: expected a finite number, got inf",)),
    Case("dashboard-port-without-dashboard", lambda p, raw: ["--port", "9000"],
         ("--port: only with --dashboard", "got 9000"), names_file=False),
    Case("dashboard-host-without-dashboard", lambda p, raw: ["--host", "0.0.0.0"],
         ("--host: only with --dashboard", "got '0.0.0.0'"), names_file=False),
    Case("blank-dashboard-token", lambda p, raw: ["--dashboard", "--host", "0.0.0.0",
                                                  "--token", "   "],
         ("--token: expected a token of at least 8 characters", "got a blank one"),
         names_file=False),
    # data paths that are not files
    Case("train-file-is-a-directory", _train_path(lambda p: p),
         ("data.train_files: existing files;", "is a directory, not a regular file")),
    Case("train-file-is-a-fifo", _train_path(_fifo),
         ("data.train_files: existing files;", "is a named pipe (FIFO), not a regular file")),
    Case("train-file-is-dev-null", _train_path(lambda p: Path(os.devnull)),
         ("data.train_files: existing files; /dev/null is a character device",)),
    Case("split-of-the-data-dir-is-a-fifo", _split_is_a_fifo,
         ("data.dir: a WikiText-2 directory:", "missing valid split",
          "wiki.valid.tokens is a named pipe (FIFO), not a regular file")),
    Case("dataset-is-a-fifo", _dataset_at(_fifo),
         ("data.dataset: a datasets builder", "train.fifo is a named pipe (FIFO)",)),
    Case("dataset-is-dev-null", _dataset_at(lambda p: Path(os.devnull)),
         ("data.dataset: a datasets builder", "got /dev/null is a character device",)),
    Case("dataset-file-is-a-fifo", _dataset_at(_fifo, builder=True),
         ("data.data_files: existing files;", "train.fifo is a named pipe (FIFO)",)),
    Case("tokenizer-is-a-fifo", lambda p, raw: raw["data"].update(tokenizer=str(_fifo(p))),
         ("data.tokenizer: a tokenizer directory", "(not a directory, and not a HuggingFace "
          "hub id)")),
    Case("token-cache-is-dev-null", _edit(data={"cache_dir": os.devnull}),
         ("data.cache_dir: a directory for the token cache, got /dev/null, which is not a "
          "directory",)),
    # storage
    Case("unparseable-url", _storage(lambda p: "sqlite//sweep.db"),
         ("invalid storage URL 'sqlite//sweep.db'",), names_file=False),
    Case("unknown-driver", _storage(lambda p: "mysql+nodriver://u:secret@localhost/db"),
         ("cannot use storage mysql+nodriver://u:***@localhost/db",), names_file=False),
    Case("sqlite-in-memory", _storage(lambda p: "sqlite://"),
         ("storage: expected a database file (e.g. sqlite:///sweepmaster.db) or a server: an "
          "in-memory SQLite database",)),
    Case("sqlite-in-memory-uri", _storage(lambda p: "sqlite:///file:sweeps?mode=memory&uri=true"),
         ("storage: expected a database file", "in-memory SQLite")),
    Case("sqlite-in-memory-uri-file", _storage(lambda p: "sqlite:///file::memory:?cache=shared"
                                               "&uri=true"),
         ("storage: expected a database file", "in-memory SQLite")),
    Case("storage-option-in-memory", lambda p, raw: ["--storage", "sqlite://"],
         ("--storage: expected a database file", "got 'sqlite://'"), names_file=False),
    Case("sqlite-opened-read-only", _read_only_database,
         ("cannot write storage sqlite:///file", "it is opened read-only"), names_file=False),
    Case("sqlite-missing-directory", _storage(lambda p: f"sqlite:///{p}/no/such/dir/s.db"),
         ("cannot open storage", "does not exist"), names_file=False),
    Case("sqlite-not-a-database", _not_a_database, ("file is not a database",),
         names_file=False),
    Case("sqlite-newer-sweepmaster", _newer_sweepmaster_sqlite,
         ("Can't locate revision identified by '9999'", "newer sweepmaster"), names_file=False),
    Case("sqlite-newer-optuna", _newer_optuna,
         ("Optuna's tables in", "'v99.0.0.a'", "unknown to optuna"), names_file=False),
    Case("sweep-exists-with-other-config", _launched_with_other_config,
         ("sweep 'tiny' already exists", "different configuration"), names_file=False),
    Case("postgres-no-server",
         _storage(lambda p: "postgresql+psycopg://postgres:secret@127.0.0.1:1/test"),
         ("cannot connect to storage postgresql+psycopg://postgres:***@127.0.0.1:1/test",),
         names_file=False),
    Case("postgres-newer-sweepmaster", _postgres(_newer_sweepmaster),
         ("Can't locate revision identified by '9999'",), names_file=False, postgres=True),
    Case("postgres-sweep-exists-with-other-config", _postgres(_pg_other_config),
         ("sweep 'tiny' already exists", "different configuration"), names_file=False,
         postgres=True),
]


def _snapshot(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every table of a database with all its rows (sorted), to prove nothing was written."""
    engine = sa.create_engine(url)
    try:
        tables = sa.inspect(engine).get_table_names()
        with engine.connect() as connection:
            return {name: sorted(map(tuple, connection.execute(
                sa.text(f'SELECT * FROM "{name}"')).all()), key=repr) for name in tables}
    finally:
        engine.dispose()


def _state(tmp_path: Path, server_url: str | None) -> Any:
    """What a launch could have written: files in the directory, and every database row.

    A SQLite file is compared by its rows (opening it may switch it to WAL mode, which rewrites
    its header, and leaves ``-wal``/``-shm`` files while a connection is open); other files by
    their bytes; a server database by its rows.
    """
    files: dict[str, Any] = {}
    for path in sorted(tmp_path.rglob("*")):
        if not path.is_file() or path.name.endswith(("-wal", "-shm")):
            continue
        data = path.read_bytes()
        if data.startswith(b"SQLite format 3\x00"):
            files[str(path.relative_to(tmp_path))] = _snapshot(f"sqlite:///{path}")
        else:
            files[str(path.relative_to(tmp_path))] = hashlib.sha256(data).digest()
    return files, (_snapshot(server_url) if server_url else None)


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=[
        *([pytest.mark.postgres] if c.postgres else []),
        *([pytest.mark.skip(reason="devices: auto is a GPU here")] if c.no_gpu and _HAS_GPU
          else [])]) for c in CASES])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    case: Case, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a default-storage or relative path would land here
    raw = tiny_sweep(tmp_path)
    if case.postgres:
        raw["postgres_url"] = request.getfixturevalue("postgres_url")
    args = case.make(tmp_path, raw)
    raw.pop("postgres_url", None)
    if args is None or args[0].startswith("--"):
        args = [str(write_sweep(tmp_path, raw)), *(args or [])]
    sweep_file = args[0]
    server_url = raw["storage"] if case.postgres else None
    before = _state(tmp_path, server_url)

    result = CliRunner().invoke(app, ["launch", *args], env=case.env)

    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    (line,) = lines
    assert line.startswith("error: "), line
    if case.names_file:
        assert line.startswith(f"error: {sweep_file}: "), line
    for fragment in case.fragments:
        assert fragment in line, line
    assert "Traceback" not in result.output
    assert _state(tmp_path, server_url) == before  # no file made or changed, no row


def test_every_config_case_fails_the_same_way_in_validate(tmp_path: Path) -> None:
    """``validate`` gives the same line as ``launch`` for every error in the file itself."""
    for case in CASES:
        if (not case.names_file and case.env is None) or case.launch_only \
                or (case.no_gpu and _HAS_GPU):
            continue
        case_dir = tmp_path / case.id
        case_dir.mkdir()
        raw = tiny_sweep(case_dir)
        args = case.make(case_dir, raw)
        if args is None or args[0].startswith("--"):  # --set: validate takes it as launch does
            args = [str(write_sweep(case_dir, raw)), *(args or [])]
        result = CliRunner().invoke(app, ["validate", *args], env=case.env)
        assert result.exit_code == 2, (case.id, result.output)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and all(f in lines[0] for f in case.fragments), (case.id, lines)


def test_the_console_script_prints_one_line(tmp_path: Path) -> None:
    """The real entry point, in a subprocess: a database file that is not one."""
    raw = tiny_sweep(tmp_path)
    _not_a_database(tmp_path, raw)
    path = write_sweep(tmp_path, raw)
    before = (tmp_path / "sweep.db").read_bytes()
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    result = subprocess.run([sys.executable, "-m", "sweepmaster", "launch", str(path)],
                            cwd=tmp_path, capture_output=True, text=True, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # not wrapped at 80 columns either
    assert result.stderr.startswith("error: cannot connect to storage sqlite:///")
    assert "file is not a database" in result.stderr
    assert (tmp_path / "sweep.db").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.db", "sweep.yaml"]


def test_a_trial_that_fails_before_training_is_recorded_and_the_sweep_goes_on(
    tmp_path: Path,
) -> None:
    """Without its pre-launch checks, the Python API lets a trial that cannot train fail alone."""
    from sweepmaster.config import parse_sweep_config
    from sweepmaster.sweep import run_sweep

    raw = tiny_sweep(tmp_path, data={"max_train_tokens": 70},
                     parameters={"train.batch_size": {"values": [4, 2]}}, train={"max_steps": 1})
    outcome = run_sweep(parse_sweep_config(raw), preflight=False)
    # its SQLite connections are closed: the -wal is checkpointed into sweep.db and removed
    assert not (tmp_path / "sweep.db-wal").exists()
    assert outcome.num_failed == 2  # batch 4 at both learning rates
    assert outcome.status == "incomplete"
    study = optuna.load_study(study_name="tiny", storage=raw["storage"])
    states = {(t.params["train.batch_size"], t.state.name) for t in study.trials}
    assert states == {(4, "FAIL"), (2, "COMPLETE")}
    reason = "ValueError: train_data has 2 blocks, fewer than one batch of 4"
    failed = [t for t in study.trials if t.state.name == "FAIL"]
    assert {t.system_attrs.get("fail_reason") for t in failed} == {reason}
    rows = sqlite3.connect(tmp_path / "sweep.db").execute(
        "SELECT trial_number, state, failure_reason FROM sm_trial_progress").fetchall()
    expected = {(t.number, t.state.name, reason if t.state.name == "FAIL" else None)
                for t in study.trials}
    assert set(rows) == expected


def test_the_python_api_runs_the_pre_launch_checks_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_sweep rejects what launch rejects, with the same error, before anything is written."""
    from sweepmaster.config import parse_sweep_config
    from sweepmaster.errors import ConfigError, SettingError
    from sweepmaster.sweep import run_sweep

    raw = tiny_sweep(tmp_path, data={"max_train_tokens": 70},
                     parameters={"train.batch_size": {"values": [4, 2]}}, train={"max_steps": 1})
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConfigError, match="train.batch_size: at most the 2 blocks"):
        run_sweep(parse_sweep_config(raw))
    monkeypatch.setenv("SWEEPMASTER_STORGE", raw["storage"])
    with pytest.raises(SettingError, match="SWEEPMASTER_STORGE: not a sweepmaster setting"):
        run_sweep(parse_sweep_config(raw))
    monkeypatch.delenv("SWEEPMASTER_STORGE")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    path = write_sweep(tmp_path, raw)
    result = CliRunner().invoke(app, ["launch", str(path)])
    assert result.exit_code == 2
    assert "train.batch_size: at most the 2 blocks" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "sweep.yaml"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a read-only file")
def test_a_read_only_database_file_is_refused_and_leaves_no_wal(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path)
    upgrade_to_head(raw["storage"])
    (tmp_path / "sweep.db").chmod(0o444)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(app, ["launch", str(write_sweep(tmp_path, raw))])
    assert result.exit_code == 2, result.output
    assert "the database file" in result.stderr and "is read-only" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "sweep.yaml"])


def test_a_database_opened_read_only_is_refused_and_leaves_no_wal(tmp_path: Path) -> None:
    """SQLite would open it, make -wal and -shm files beside it, fail to write, and keep them."""
    raw = tiny_sweep(tmp_path)
    _read_only_database(tmp_path, raw)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(app, ["launch", str(write_sweep(tmp_path, raw))])
    assert result.exit_code == 2, result.output
    assert "it is opened read-only" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "sweep.yaml"])
