"""sweep.yaml schema: valid files, every error kind, the search space and trial configs."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from sweepmaster.config import SweepConfig, load_sweep_config, parse_sweep_config
from sweepmaster.errors import ConfigError
from sweepmaster.study import PRUNER_CLASSES, SAMPLER_CLASSES
from tests.kit.data import SHIPPED_DATA, TOKENIZER_DIR, WIKITEXT_DIR

GPT2_TOKENIZER = SHIPPED_DATA / "gpt2-tokenizer"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A directory with a tiny WikiText-style split dir and a fake GPT-2 tokenizer dir."""
    wiki = tmp_path / "wiki"
    wiki.mkdir()
    for split in ("train", "valid"):
        (wiki / f"wiki.{split}.tokens").write_text(" = Title = \n some text \n")
    shutil.copytree(GPT2_TOKENIZER, tmp_path / "tok")  # the loader checks that it loads
    return tmp_path


def minimal() -> dict[str, Any]:
    return {"name": "tiny", "model": {"config": {"n_layer": 1}},
            "data": {"dir": "wiki", "tokenizer": "tok"}}


def merged(base: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """``base`` with each given section's keys replaced (``None`` deletes a key)."""
    raw = copy.deepcopy(base)
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(name), dict) and name != "parameters":
            raw[name] = {**raw[name], **value}
            raw[name] = {k: v for k, v in raw[name].items() if v is not None}
        else:
            raw[name] = value
    return raw


def write(root: Path, raw: Any, name: str = "sweep.yaml") -> Path:
    path = root / name
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw, sort_keys=False))
    return path


def load(root: Path, **sections: Any) -> SweepConfig:
    return load_sweep_config(write(root, merged(minimal(), **sections)))


def error(root: Path, raw: Any, key: str, *fragments: str, name: str = "sweep.yaml") -> str:
    """Load ``raw`` from a file, expect a ConfigError at ``key``; return its message."""
    path = write(root, raw, name)
    with pytest.raises(ConfigError) as info:
        load_sweep_config(path)
    message = str(info.value)
    assert info.value.key == key, message
    assert message.startswith(f"{path}: {key}: " if key else f"{path}: "), message
    assert name in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def section_error(root: Path, key: str, *fragments: str, **sections: Any) -> str:
    return error(root, merged(minimal(), **sections), key, *fragments)


# --- valid files -----------------------------------------------------------------------------

def test_minimal_file_gets_the_defaults(root: Path) -> None:
    config = load(root)
    assert config.name == "tiny"
    assert config.source == str(root / "sweep.yaml")
    assert config.storage == "sqlite:///sweepmaster.db"
    study = config.study
    assert (study.direction, study.metric, study.seed, study.n_trials) == (
        "minimize", "eval_loss", None, None)
    assert (study.sampler.type, study.sampler.kwargs()) == ("grid", {})
    assert (study.pruner.type, study.pruner.kwargs()) == ("none", {})
    assert config.model.pretrained is None and config.model.dtype == "float32"
    assert config.data.dir == root / "wiki" and config.data.tokenizer == root / "tok"
    assert config.data.block_size == 128 and config.data.cache_dir is None
    train = config.train
    assert (train.epochs, train.max_steps, train.batch_size, train.optimizer, train.lr) == (
        1.0, None, 8, "adamw", 3e-4)
    assert train.betas == (0.9, 0.999) and train.schedule == "constant" and train.seed == 0
    assert config.resources.devices == "auto" and config.resources.device_memory is None
    assert config.output.dir == Path("checkpoints") and config.output.save == "best"
    assert config.parameters == {} and config.search_space() == {} and config.grid_size() == 1


FULL_YAML = """\
name: gpt2-full.v1
storage: sqlite:///runs/sweeps.db
study:
  direction: maximize
  metric: eval_perplexity
  sampler: {type: tpe, n_startup_trials: 5, multivariate: true}
  seed: 7
  pruner: {type: median, n_startup_trials: 2, n_warmup_steps: 1}
  n_trials: 20
model:
  config: {model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 2, n_positions: 256}
  dtype: bfloat16
data:
  train_files: [wiki/wiki.train.tokens]
  valid_files: [wiki/wiki.valid.tokens]
  tokenizer: tok
  block_size: 64
  max_train_tokens: 10000
  max_eval_tokens: 2000
  cache_dir: cache
train:
  epochs: 2
  max_steps: 100
  batch_size: 4
  optimizer: sgd
  lr: 1e-3
  weight_decay: 0.01
  betas: [0.8, 0.99]
  momentum: 0.9
  warmup_steps: 10
  schedule: cosine
  grad_clip: 1.0
  eval_every: 25
  seed: 3
resources: {devices: "cuda:0,cuda:1", device_memory: 8GiB}
output: {dir: out, save: all}
parameters:
  train.lr: {min: 1e-5, max: 1e-2, distribution: log_uniform_values}
  train.batch_size: {values: [2, 4, 8]}
  model.config.n_layer: {min: 1, max: 3}
  train.weight_decay: {value: 0.1}
"""


def test_full_file(root: Path) -> None:
    config = load_sweep_config(write(root, FULL_YAML))
    assert config.name == "gpt2-full.v1" and config.storage == "sqlite:///runs/sweeps.db"
    assert config.study.direction == "maximize" and config.study.metric == "eval_perplexity"
    assert config.study.sampler.type == "tpe"
    assert config.study.sampler.kwargs() == {"n_startup_trials": 5, "multivariate": True}
    assert config.study.pruner.type == "median"
    assert config.study.pruner.kwargs() == {"n_startup_trials": 2, "n_warmup_steps": 1}
    assert (config.study.seed, config.study.n_trials) == (7, 20)
    assert config.model.config == {"model_type": "gpt2", "n_layer": 2, "n_embd": 64,
                                   "n_head": 2, "n_positions": 256}
    assert config.model.dtype == "bfloat16"
    data = config.data
    assert data.dir is None and data.train_files == [root / "wiki" / "wiki.train.tokens"]
    assert data.valid_files == [root / "wiki" / "wiki.valid.tokens"]
    assert data.cache_dir == root / "cache"
    assert (data.block_size, data.max_train_tokens, data.max_eval_tokens) == (64, 10000, 2000)
    train = config.train
    assert train.lr == 1e-3 and isinstance(train.lr, float)  # "1e-3" is a float, not a string
    assert (train.epochs, train.max_steps, train.batch_size, train.optimizer) == (
        2.0, 100, 4, "sgd")
    assert train.betas == (0.8, 0.99) and train.momentum == 0.9 and train.grad_clip == 1.0
    assert (train.warmup_steps, train.schedule, train.eval_every, train.seed) == (
        10, "cosine", 25, 3)
    assert config.resources.devices == "cuda:0,cuda:1"
    assert config.output.dir == Path("out") and config.output.save == "all"
    assert config.search_space() == {
        "train.lr": FloatDistribution(1e-5, 1e-2, log=True),
        "train.batch_size": CategoricalDistribution([2, 4, 8]),
        "model.config.n_layer": IntDistribution(1, 3),
    }
    assert config.constants() == {"train.weight_decay": 0.1}


def test_wikitext_and_tokenizer_of_the_test_data(tmp_path: Path) -> None:
    raw = merged(minimal(), data={"dir": str(WIKITEXT_DIR), "tokenizer": str(TOKENIZER_DIR)})
    config = load_sweep_config(write(tmp_path, raw))
    assert config.data.dir == WIKITEXT_DIR


def test_relative_data_paths_follow_the_yaml_file_not_the_cwd(
        root: Path, tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    monkeypatch.chdir(elsewhere)
    (root / "sub").mkdir()
    raw = merged(minimal(), data={"dir": "../wiki", "tokenizer": "../tok", "cache_dir": "c"},
                 storage="sqlite:///rel.db", output={"dir": "ckpt"})
    config = load_sweep_config(write(root / "sub", raw))
    assert config.data.dir == root / "wiki" and config.data.tokenizer == root / "tok"
    assert config.data.cache_dir == root / "sub" / "c"
    assert config.storage == "sqlite:///rel.db" and config.output.dir == Path("ckpt")


def test_parse_mapping_without_file_checks() -> None:
    raw = merged(minimal(), data={"dir": "/nonexistent/wiki", "tokenizer": "/nonexistent/tok"})
    config = parse_sweep_config(raw, check_files=False)
    assert config.source == "<mapping>" and config.data.dir == Path("/nonexistent/wiki")
    with pytest.raises(ConfigError, match=r"^<mapping>: data\.dir: "):
        parse_sweep_config(raw)


def test_pretrained_is_a_local_dir_else_a_hub_id(root: Path, monkeypatch: pytest.MonkeyPatch,
                                                ) -> None:
    model_dir = root / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"n_positions": 64}))
    local = load(root, model={"config": None, "pretrained": "my-model"}, data={"block_size": 64})
    assert local.model.pretrained == str(model_dir)
    monkeypatch.setenv("HF_HOME", str(root / "hf-home"))  # an empty cache, offline
    with pytest.raises(ConfigError, match="model.pretrained: a model directory saved with "
                       "save_pretrained or a HuggingFace hub id, got openai-community/gpt2 "
                       r"\(no such directory, and not in the HuggingFace cache .*HF_HUB_OFFLINE "
                       "is set"):
        load(root, model={"config": None, "pretrained": "openai-community/gpt2"})


def test_sampler_and_pruner_tables_for_study_py(root: Path) -> None:
    assert set(SAMPLER_CLASSES) == {"grid", "tpe", "random", "cmaes", "gp", "qmc"}
    assert SAMPLER_CLASSES["cmaes"] is optuna.samplers.CmaEsSampler
    assert PRUNER_CLASSES["none"] is optuna.pruners.NopPruner
    assert PRUNER_CLASSES["successive_halving"] is optuna.pruners.SuccessiveHalvingPruner
    config = load(root, study={"sampler": "random", "n_trials": 3, "seed": 1,
                               "pruner": {"type": "hyperband", "max_resource": 30}})
    assert config.study.pruner.kwargs() == {"max_resource": 30}
    sampler = SAMPLER_CLASSES[config.study.sampler.type](seed=config.study.seed,
                                                         **config.study.sampler.kwargs())
    assert isinstance(sampler, optuna.samplers.RandomSampler)
    PRUNER_CLASSES[config.study.pruner.type](**config.study.pruner.kwargs())


# --- file-level errors -----------------------------------------------------------------------

def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: no such file$"):
        load_sweep_config(tmp_path / "nope.yaml")


def test_yaml_syntax_error_gives_line_and_column(root: Path) -> None:
    message = error(root, "name: x\nstudy:\n  sampler: [tpe\n", "", "invalid YAML at line 4:1")
    assert "expected" in message


@pytest.mark.parametrize(("text", "got"), [("- a\n- b\n", "got list"), ("", "got an empty file"),
                                           ("just a string\n", "got str")])
def test_top_level_must_be_a_mapping(root: Path, text: str, got: str) -> None:
    error(root, text, "", "expected a mapping", got)


def test_unknown_top_level_key_suggests(root: Path) -> None:
    error(root, merged(minimal(), studdy={}), "studdy", "unknown key; did you mean 'study'?",
          "allowed: name, storage, study")


def test_unknown_nested_key_suggests(root: Path) -> None:
    section_error(root, "train.lrr", "did you mean 'lr'?", train={"lrr": 0.1})


@pytest.mark.parametrize(("sections", "key", "fragment"), [
    ({"train": {"batch_size": "eight"}}, "train.batch_size",
     "expected an integer >= 1, got 'eight'"),
    ({"train": {"epochs": "long"}}, "train.epochs", "expected a number > 0, got 'long'"),
    ({"train": {"grad_clip": "x"}}, "train.grad_clip", "expected a number > 0 or null"),
    ({"train": {"optimizer": "adamm"}}, "train.optimizer",
     "expected one of 'adamw', 'sgd', 'lion', got 'adamm'; did you mean 'adamw'?"),
    ({"train": {"betas": [0.9]}}, "train.betas.1", "missing"),
    ({"study": {"direction": "down"}}, "study.direction", "'minimize', 'maximize'"),
    ({"model": {"dtype": "fp8"}}, "model.dtype", "'float32', 'bfloat16', 'float16'"),
    ({"data": {"tokenizer": None}}, "data.tokenizer", "missing, expected a path"),
    ({"study": "fast"}, "study", "expected a mapping, got 'fast'"),
    ({"name": "-dash-first"}, "name", "matching ^[A-Za-z0-9][A-Za-z0-9_.-]*$"),
    ({"name": "has space"}, "name", "got 'has space'"),
    ({"resources": {"devices": ""}}, "resources.devices", "expected a non-empty string"),
])
def test_wrong_type(root: Path, sections: dict[str, Any], key: str, fragment: str) -> None:
    section_error(root, key, fragment, **sections)


@pytest.mark.parametrize(("sections", "key", "fragment"), [
    ({"train": {"batch_size": 0}}, "train.batch_size", "expected an integer >= 1, got 0"),
    ({"train": {"lr": -0.1}}, "train.lr", "expected a number > 0, got -0.1"),
    ({"train": {"betas": [0.9, 1.0]}}, "train.betas.1", "expected a number >= 0 and < 1, got 1.0"),
    ({"train": {"warmup_steps": -1}}, "train.warmup_steps", ">= 0"),
    ({"data": {"block_size": 1}}, "data.block_size", "expected an integer >= 2, got 1"),
    ({"study": {"n_trials": 0}}, "study.n_trials", "expected an integer >= 1 or null, got 0"),
])
def test_out_of_range(root: Path, sections: dict[str, Any], key: str, fragment: str) -> None:
    section_error(root, key, fragment, **sections)


def test_several_errors_report_the_first_and_count_the_rest(root: Path) -> None:
    section_error(root, "train.epochs", "(and 2 more)",  # schema order, not file order
                  train={"batch_size": 0, "lr": 0, "epochs": 0})


# --- study ------------------------------------------------------------------------------------

def test_unknown_sampler_and_pruner(root: Path) -> None:
    section_error(root, "study.sampler.type", "got 'tpee'; did you mean 'tpe'?",
                  study={"sampler": "tpee"})
    section_error(root, "study.pruner.type", "did you mean 'median'?",
                  study={"pruner": {"type": "medain"}})
    section_error(root, "study.sampler", "expected a name or a mapping", study={"sampler": 3})


def test_bad_sampler_kwargs(root: Path) -> None:
    tpe = {"type": "tpe"}
    section_error(root, "study.sampler.n_startup", "keyword of optuna's TPESampler: one of",
                  "did you mean 'n_startup_trials'?",
                  study={"n_trials": 5, "sampler": {**tpe, "n_startup": 5}})
    section_error(root, "study.sampler.n_startup_trials", "expected int, got 'five'",
                  study={"n_trials": 5, "sampler": {**tpe, "n_startup_trials": "five"}})
    section_error(root, "study.sampler.seed", "study.seed",
                  study={"n_trials": 5, "sampler": {**tpe, "seed": 1}})
    section_error(root, "study.sampler.gamma", "not settable from YAML",
                  study={"n_trials": 5, "sampler": {**tpe, "gamma": 0.1}})
    section_error(root, "study.sampler.search_space", "parameters",
                  study={"sampler": {"type": "grid", "search_space": {}}})


def test_pruner_kwargs(root: Path) -> None:
    config = load(root, study={"pruner": {"type": "successive_halving", "min_resource": "auto",
                                          "reduction_factor": 3}})
    assert config.study.pruner.kwargs() == {"min_resource": "auto", "reduction_factor": 3}
    section_error(root, "study.pruner.n_warmup", "MedianPruner", "did you mean 'n_warmup_steps'?",
                  study={"pruner": {"type": "median", "n_warmup": 2}})
    section_error(root, "study.pruner.n_warmup_steps", "expected int, got 1.5",
                  study={"pruner": {"type": "median", "n_warmup_steps": 1.5}})
    section_error(root, "study.pruner.interval", "one of (none)",
                  study={"pruner": {"type": "none", "interval": 2}})


def test_n_trials_required_except_for_grid(root: Path) -> None:
    section_error(root, "study.n_trials", "required with the tpe sampler",
                  study={"sampler": "tpe"})
    assert load(root, study={"sampler": "tpe", "n_trials": 4}).study.n_trials == 4


# --- model ------------------------------------------------------------------------------------

def test_model_needs_exactly_one_of_config_and_pretrained(root: Path) -> None:
    section_error(root, "model", "exactly one of model.config", "got both",
                  model={"pretrained": "gpt2"})
    section_error(root, "model", "got neither", model={"config": None})


def test_unknown_model_config_key_suggests(root: Path) -> None:
    section_error(root, "model.config.n_layr",
                  "unknown key (not a field of GPT2Config); did you mean 'n_layer'?",
                  model={"config": {"n_layr": 2}})
    section_error(root, "model.config.model_type", "did you mean 'gpt2'?",
                  model={"config": {"model_type": "gtp2"}})


def test_model_config_value_of_wrong_type(root: Path) -> None:
    section_error(root, "model.config.n_layer", "expected int, got str",
                  model={"config": {"n_layer": "two"}})


@pytest.mark.parametrize("positions_key", ["n_positions", "max_position_embeddings"])
def test_n_positions_below_block_size(root: Path, positions_key: str) -> None:
    section_error(root, "data.block_size", "at most model.config.n_positions (64), got 128",
                  model={"config": {positions_key: 64}})
    config = load(root, model={"config": {positions_key: 64}}, data={"block_size": 64})
    assert config.data.block_size == 64


def test_pretrained_dir_errors(root: Path) -> None:
    (root / "no-config").mkdir()
    section_error(root, "model.pretrained", "a model directory with a readable config.json",
                  model={"config": None, "pretrained": "no-config"})
    section_error(root, "model.pretrained", "got ./missing (no such directory, and not a "
                  "HuggingFace hub id)", model={"config": None, "pretrained": "./missing"})
    (root / "small").mkdir()
    (root / "small" / "config.json").write_text(json.dumps({"n_positions": 32}))
    section_error(root, "data.block_size", "(32), got 128",
                  model={"config": None, "pretrained": "small"})


# --- data -------------------------------------------------------------------------------------

def test_missing_data_dir(root: Path) -> None:
    section_error(root, "data.dir", f"an existing directory, got {root / 'nowhere'}",
                  data={"dir": "nowhere"})


def test_data_dir_without_valid_split(root: Path) -> None:
    (root / "wiki" / "wiki.valid.tokens").unlink()
    section_error(root, "data.dir", str(root / "wiki"), "wiki.valid.tokens or wiki.valid.raw")


def test_data_dir_with_raw_splits(root: Path) -> None:
    raw_dir = root / "raw"
    raw_dir.mkdir()
    for split in ("train", "valid"):
        (raw_dir / f"wiki.{split}.raw").write_text("text\n")
    assert load(root, data={"dir": "raw"}).data.dir == raw_dir


def test_missing_tokenizer(root: Path) -> None:
    section_error(root, "data.tokenizer", "got nope (no such directory, and not in the "
                  "HuggingFace cache", data={"tokenizer": "nope"})
    section_error(root, "data.tokenizer", f"got {root / 'nope'} (no such directory, and not a "
                  "HuggingFace hub id)", data={"tokenizer": str(root / "nope")})
    (root / "empty-tok").mkdir()
    section_error(root, "data.tokenizer", "vocab.json and merges.txt",
                  data={"tokenizer": "empty-tok"})
    (root / "fast-tok").mkdir()
    (root / "fast-tok" / "tokenizer.json").write_text("{}")
    section_error(root, "data.tokenizer", "a loadable tokenizer directory",
                  str(root / "fast-tok"), data={"tokenizer": "fast-tok"})
    (root / "fast-tok" / "tokenizer.json").write_text("{not json")
    section_error(root, "data.tokenizer", "a loadable tokenizer directory",
                  data={"tokenizer": "fast-tok"})
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(GPT2_TOKENIZER).save_pretrained(root / "fast-tok")
    assert load(root, data={"tokenizer": "fast-tok"}).data.tokenizer == root / "fast-tok"


def test_train_files(root: Path) -> None:
    section_error(root, "data.train_files", f"no such file: {root / 'missing.txt'}",
                  data={"dir": None, "train_files": ["missing.txt"]})
    section_error(root, "data", "exactly one of data.dir", "got both",
                  data={"train_files": ["wiki/wiki.train.tokens"]})
    section_error(root, "data", "got neither", data={"dir": None})
    section_error(root, "data.valid_files", "only with data.train_files",
                  data={"valid_files": ["wiki/wiki.valid.tokens"]})
    # without validation text the objective can only be the training loss
    section_error(root, "study.metric", "train_loss, or data.valid_files to compute eval_loss "
                  "on (data.train_files has no validation split), got 'eval_loss'",
                  data={"dir": None, "train_files": ["wiki/wiki.train.tokens"]})
    config = load(root, data={"dir": None, "train_files": ["wiki/wiki.train.tokens"]},
                  study={"metric": "train_loss"})
    assert config.data.valid_files is None


# --- parameters -------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "distribution"), [
    ({"values": [1e-3, 1e-2]}, CategoricalDistribution([1e-3, 1e-2])),
    ({"values": [0.1, 0.2], "distribution": "categorical"}, CategoricalDistribution([0.1, 0.2])),
    ({"min": 0.001, "max": 0.1, "distribution": "uniform"}, FloatDistribution(0.001, 0.1)),
    ({"min": 1e-5, "max": 1e-2, "distribution": "log_uniform_values"},
     FloatDistribution(1e-5, 1e-2, log=True)),
    ({"min": 0.01, "max": 0.05, "distribution": "q_uniform", "q": 0.01},
     FloatDistribution(0.01, 0.05, step=0.01)),
    ({"min": 1, "max": 3, "distribution": "q_uniform"}, FloatDistribution(1.0, 3.0, step=1.0)),
    ({"min": 0.1, "max": 0.5, "q": 0.2}, FloatDistribution(0.1, 0.5, step=0.2)),
    ({"min": 1, "max": 4, "distribution": "uniform"}, FloatDistribution(1.0, 4.0)),
    ({"min": 0.001, "max": 0.1}, FloatDistribution(0.001, 0.1)),
    ({"min": 1, "max": 2.5}, FloatDistribution(1.0, 2.5)),
])
def test_float_distributions(root: Path, spec: dict[str, Any],
                             distribution: optuna.distributions.BaseDistribution) -> None:
    config = load(root, study={"sampler": "random", "n_trials": 2},
                  parameters={"train.lr": spec})
    assert config.search_space() == {"train.lr": distribution}
    assert config.constants() == {}


@pytest.mark.parametrize(("spec", "distribution"), [
    ({"min": 1, "max": 4, "distribution": "int_uniform"}, IntDistribution(1, 4)),
    ({"min": 1, "max": 4}, IntDistribution(1, 4)),
    ({"values": [2, 4]}, CategoricalDistribution([2, 4])),
])
def test_int_distributions(root: Path, spec: dict[str, Any],
                           distribution: optuna.distributions.BaseDistribution) -> None:
    config = load(root, study={"sampler": "tpe", "n_trials": 2},
                  parameters={"model.config.n_layer": spec})
    assert config.search_space() == {"model.config.n_layer": distribution}


def test_constants_are_not_sampled(root: Path) -> None:
    config = load(root, parameters={
        "train.betas": {"value": [0.8, 0.9]},
        "train.schedule": {"value": "cosine", "distribution": "constant"},
        "train.grad_clip": {"value": None},
    })
    assert config.search_space() == {} and config.grid_space() == {}
    assert config.constants() == {"train.betas": [0.8, 0.9], "train.schedule": "cosine",
                                  "train.grad_clip": None}


def test_betas_are_swept_as_comma_separated_pairs(root: Path) -> None:
    config = load(root, parameters={"train.betas": {"values": ["0.9,0.999", "0.9, 0.95"]}})
    assert config.grid_space() == {"train.betas": ["0.9,0.999", "0.9, 0.95"]}
    assert config.with_params({"train.betas": "0.9, 0.95"}).train.betas == (0.9, 0.95)
    with pytest.raises(ConfigError, match=r"train.betas: expected two numbers in \[0, 1\): a "
                       r"list, or one string of two numbers separated by a comma"):
        config.with_params({"train.betas": "0.9;0.95"})


@pytest.mark.parametrize(("spec", "key", "fragments"), [
    ({"min": 1e-3, "max": 1e-2, "distribution": "normal"}, "parameters.train.lr.distribution",
     ["one of constant, categorical, uniform, int_uniform, q_uniform, log_uniform_values",
      "got 'normal'"]),
    ({"min": 0.1, "max": 0.01}, "parameters.train.lr.max", ["greater than min (0.1), got 0.01"]),
    ({"min": 0.1, "max": 0.1}, "parameters.train.lr.max", ["greater than min"]),
    ({"min": 0.0, "max": 0.1, "distribution": "log_uniform_values"}, "parameters.train.lr.min",
     ["> 0 for log_uniform_values, got 0.0"]),
    ({"values": [0.1], "min": 0.1, "max": 1.0}, "parameters.train.lr",
     ["exactly one of `value`, `values` or `min`/`max`, got values and min/max"]),
    ({"value": 0.1, "values": [0.1]}, "parameters.train.lr", ["got value and values"]),
    ({"values": []}, "parameters.train.lr.values", ["a non-empty list"]),
    ({"values": [[0.1, 0.2]]}, "parameters.train.lr.values",
     ["Optuna's categorical", "got [0.1, 0.2] (a list of names or numbers is one "
      "comma-separated string, e.g. '0.1,0.2')"]),
    ({"min": 0.1}, "parameters.train.lr.max", ["required"]),
    ({"min": "small", "max": 1.0}, "parameters.train.lr.min", ["a number, got 'small'"]),
    ({"min": 0.5, "max": 4, "distribution": "int_uniform"}, "parameters.train.lr.min",
     ["an integer for int_uniform"]),
    ({"min": 0.1, "max": 1.0, "q": 0.1, "distribution": "uniform"}, "parameters.train.lr.q",
     ["only with distribution q_uniform"]),
    ({"distribution": "categorical"}, "parameters.train.lr.values", ["required"]),
    ({"values": [0.1], "distribution": "uniform"}, "parameters.train.lr.distribution",
     ["categorical with `values`"]),
    ({}, "parameters.train.lr", ["`value`, `values`, or `min` and `max`"]),
    ({"vals": [0.1]}, "parameters.train.lr.vals", ["unknown key; did you mean 'values'?"]),
    (0.1, "parameters.train.lr", ["expected a mapping, got 0.1"]),
    ({"values": [0.1, "fast"]}, "parameters.train.lr", ["expected a number > 0, got 'fast'"]),
    ({"values": [0.1, -0.1]}, "parameters.train.lr", ["expected a number > 0, got -0.1"]),
    ({"min": -1.0, "max": 1.0}, "parameters.train.lr", ["expected a number > 0, got -1.0"]),
])
def test_parameter_errors(root: Path, spec: Any, key: str, fragments: list[str]) -> None:
    section_error(root, key, *fragments, study={"sampler": "random", "n_trials": 2},
                  parameters={"train.lr": spec})


@pytest.mark.parametrize(("path", "spec", "key", "fragments"), [
    ("train.lrr", {"values": [0.1]}, "parameters.train.lrr",
     ["a dotted path to a model, data or train setting", "did you mean 'train.lr'?"]),
    ("model.config.n_layr", {"values": [1]}, "parameters.model.config.n_layr",
     ["a field of GPT2Config under model.config; did you mean 'n_layer'?"]),
    ("name", {"values": ["a", "b"]}, "parameters.name", ["a dotted path"]),
    ("train.batch_size", {"values": [4, "eight"]}, "parameters.train.batch_size",
     ["expected an integer >= 1, got 'eight'"]),
    ("train.batch_size", {"min": 0.5, "max": 8.5}, "parameters.train.batch_size",
     ["got 0.5"]),
    ("train.optimizer", {"values": ["adamw", "adam"]}, "parameters.train.optimizer",
     ["got 'adam'"]),
    ("model.config.n_layer", {"values": [1, 2.5]}, "parameters.model.config.n_layer",
     ["expected int, got float"]),
    ("model.config.n_layer", {"min": 1, "max": 3, "distribution": "q_uniform"},
     "parameters.model.config.n_layer", ["expected int, got float (value: 1.0)"]),
    ("data.block_size", {"values": [64, 2048]}, "parameters.data.block_size",
     ["at most model.config.n_positions (1024), got 2048"]),
    ("model.config.n_positions", {"value": 64}, "parameters.model.config.n_positions",
     ["with 64, data.block_size: at most model.config.n_positions (64), got 128"]),
    ("data.tokenizer", {"values": ["tok", "missing-tok"]}, "parameters.data.tokenizer",
     ["a tokenizer directory or a HuggingFace hub id, got missing-tok (no such directory"]),
])
def test_parameter_path_and_type_errors(root: Path, path: str, spec: Any, key: str,
                                        fragments: list[str]) -> None:
    fragments = [f.replace("{root}", str(root)) for f in fragments]
    section_error(root, key, *fragments, study={"sampler": "random", "n_trials": 2},
                  parameters={path: spec})


def test_model_config_parameter_needs_model_config(root: Path) -> None:
    (root / "m").mkdir()
    (root / "m" / "config.json").write_text("{}")
    section_error(root, "parameters.model.config.n_layer", "model.config to be set",
                  model={"config": None, "pretrained": "m"},
                  parameters={"model.config.n_layer": {"values": [1, 2]}})


# --- grid ------------------------------------------------------------------------------------

def test_grid_space_enumerates_values_int_and_q_ranges(root: Path) -> None:
    config = load(root, parameters={
        "train.lr": {"values": [1e-3, 1e-2]},
        "model.config.n_layer": {"min": 1, "max": 3},
        "train.weight_decay": {"min": 0.0, "max": 0.3, "q": 0.1, "distribution": "q_uniform"},
        "train.seed": {"value": 5},
    })
    assert config.grid_space() == {
        "train.lr": [1e-3, 1e-2],
        "model.config.n_layer": [1, 2, 3],
        "train.weight_decay": [0.0, 0.1, 0.2, 0.3],
    }
    assert config.grid_size() == 2 * 3 * 4


def test_grid_of_a_continuous_distribution(root: Path) -> None:
    section_error(root, "parameters.train.lr",
                  "a grid needs `values` (or int_uniform / q_uniform), got distribution uniform",
                  parameters={"train.lr": {"min": 0.001, "max": 0.1}})
    section_error(root, "parameters.train.lr", "got distribution log_uniform_values",
                  parameters={"train.lr": {"min": 0.001, "max": 0.1,
                                           "distribution": "log_uniform_values"}})
    config = load(root, study={"sampler": "tpe", "n_trials": 3},
                  parameters={"train.lr": {"min": 0.001, "max": 0.1}})
    with pytest.raises(ConfigError) as info:
        config.grid_space()
    assert info.value.key == "parameters.train.lr" and "sweep.yaml" in str(info.value)


# --- trial configs ---------------------------------------------------------------------------

def test_with_params_applies_constants_and_nested_paths(root: Path) -> None:
    config = load(root, parameters={"train.lr": {"values": [1e-3, 1e-2]},
                                    "model.config.n_layer": {"values": [1, 2]},
                                    "train.warmup_steps": {"value": 5}})
    trial = config.with_params({"train.lr": 1e-2, "model.config.n_layer": 2,
                                "data.block_size": 64})
    assert trial.train.lr == 1e-2 and trial.model.config == {"n_layer": 2}
    assert trial.train.warmup_steps == 5 and trial.data.block_size == 64
    assert trial.source == config.source and trial.data.dir == config.data.dir
    assert trial.parameters == config.parameters
    assert config.train.lr == 3e-4 and config.model.config == {"n_layer": 1}  # unchanged
    assert config.with_params({}).train.warmup_steps == 5


@pytest.mark.parametrize(("params", "key", "fragment"), [
    ({"train.lr": "fast"}, "train.lr", "expected a number > 0, got 'fast'"),
    ({"train.batch_size": 2.5}, "train.batch_size", "expected an integer >= 1"),
    ({"model.config.n_layer": "two"}, "model.config.n_layer", "expected int, got str"),
    ({"model.config.n_positions": 64}, "data.block_size", "at most model.config.n_positions"),
    ({"train.lrr": 0.1}, "train.lrr", "did you mean 'train.lr'?"),
])
def test_with_params_rejects_bad_values(root: Path, params: dict[str, Any], key: str,
                                        fragment: str) -> None:
    config = load(root)
    with pytest.raises(ConfigError) as info:
        config.with_params(params)
    assert info.value.key == key and fragment in str(info.value)
    assert str(info.value).startswith(f"{root / 'sweep.yaml'}: {key}: ")


def test_canonical_text_is_stable_across_key_order(root: Path) -> None:
    raw = merged(minimal(), study={"sampler": {"type": "tpe", "n_startup_trials": 3,
                                               "multivariate": True}, "n_trials": 4},
                 train={"lr": 0.01, "batch_size": 4},
                 parameters={"train.lr": {"min": 1e-4, "max": 1e-2},
                             "train.batch_size": {"values": [2, 4]}})

    def reverse(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: reverse(node[k]) for k in reversed(list(node))}
        return node

    first = load_sweep_config(write(root, raw, "a.yaml"))
    second = load_sweep_config(write(root, reverse(raw), "b.yaml"))
    assert first.source != second.source
    assert first.canonical_text() == second.canonical_text()
    assert first.fingerprint() == second.fingerprint()
    assert "a.yaml" not in first.canonical_text()
    changed = load_sweep_config(write(root, merged(raw, train={"lr": 0.02}), "c.yaml"))
    assert changed.canonical_text() != first.canonical_text()
    # The text is a complete, re-loadable description of the sweep.
    again = parse_sweep_config(yaml.safe_load(first.canonical_text()), "db")
    assert again.canonical_text() == first.canonical_text()
    assert again.search_space() == first.search_space()


def test_configs_are_frozen(root: Path) -> None:
    config = load(root)
    with pytest.raises(Exception, match="frozen"):
        config.train.lr = 0.1  # type: ignore[misc]


# --- resources -------------------------------------------------------------------------------

@pytest.mark.parametrize(("resources", "key", "fragments"), [
    ({"devices": "gpu:0"}, "resources.devices",
     ("expected a device spec: auto, cpu, cuda, cuda:N or cpu:KxSIZE", "unknown device 'gpu:0'",
      "got 'gpu:0'")),
    ({"devices": "cpu:2x5XB"}, "resources.devices", ("'5xb' is not a size", "got 'cpu:2x5XB'")),
    ({"devices": "cpu:0x512MiB"}, "resources.devices", ("asks for no device",)),
    ({"devices": "cuda:0,cuda"}, "resources.devices", ("names cuda:0 twice",)),
    ({"devices": "cpu,,cpu"}, "resources.devices", ("an entry is empty",)),
    ({"devices": 4}, "resources.devices", ("expected a non-empty string, got 4",)),
    ({"device_memory": "8 GB!"}, "resources.device_memory",
     ("expected a positive size with a unit B, KiB, MiB, GiB or TiB", "got '8 GB!'")),
    ({"device_memory": 0}, "resources.device_memory", ("expected a positive size", "got 0")),
    ({"device_memory": 2**30}, "resources.device_memory",
     ("the size 1073741824 has no unit; write 1073741824MiB, 1073741824GiB or 1073741824B",
      "got 1073741824")),
    ({"device_memory": "1.5"}, "resources.device_memory",
     ("the size 1.5 has no unit", "got '1.5'")),
    ({"device_memory": True}, "resources.device_memory",
     ("expected a positive size with a unit", "8GiB, got True")),
    ({"device_memory": 8.5}, "resources.device_memory",
     ("expected a positive size with a unit", "the size 8.5 has no unit", "got 8.5")),
    ({"device_memory": [1]}, "resources.device_memory",
     ("expected a positive size with a unit", "got [1]")),
    ({"fusion": 0}, "resources.fusion",
     ("expected auto, off or an integer >= 1 (the fusion degree K)", "got 0")),
    ({"fusion": "sometimes"}, "resources.fusion", ("expected auto, off or an integer",
                                                   "got 'sometimes'")),
    ({"fusion": True}, "resources.fusion", ("expected auto, off or an integer", "got True")),
    ({"fusion": 2.5}, "resources.fusion", ("got 2.5",)),
    ({"pipeline": "sometimes"}, "resources.pipeline", ("expected auto or off",
                                                       "got 'sometimes'")),
    ({"pipeline": 2}, "resources.pipeline", ("expected auto or off", "got 2")),
    ({"update_on": "cpu"}, "resources.update_on", ("expected one of 'auto', 'device', 'host'",
                                                   "got 'cpu'")),
])
def test_bad_resources(root: Path, resources: dict[str, Any], key: str,
                       fragments: tuple[str, ...]) -> None:
    message = section_error(root, key, *fragments, resources=resources)
    assert "\n" not in message


@pytest.mark.parametrize(("devices", "memory"), [
    ("auto", None), ("cpu", "512MiB"), ("cpu:2x512MiB", None), ("cpu:1.5GiB", "4096B"),
    ("cuda:0,cuda:1", "8GiB"), ("cuda:7", None), ("CPU:1x64mib, cuda", None),
])
def test_device_specs_are_checked_for_syntax_only(root: Path, devices: str,
                                                  memory: str | int | None) -> None:
    config = load(root, resources={"devices": devices, "device_memory": memory})
    assert (config.resources.devices, config.resources.device_memory) == (devices, memory)


def test_fusion_is_auto_off_or_a_degree(root: Path) -> None:
    assert load(root).resources.fusion == "off"
    assert load(root, resources={"fusion": "auto"}).resources.fusion == "auto"
    assert load(root, resources={"fusion": 4}).resources.fusion == 4
    text = write(root, merged(minimal())).read_text() + "resources:\n  fusion: off\n"
    bare = root / "bare.yaml"
    bare.write_text(text)  # YAML 1.1 reads a bare `off` as false
    assert load_sweep_config(bare).resources.fusion == "off"
    assert load(root, resources={"fusion": 4}).fingerprint() == load(root).fingerprint()


def test_pipeline_is_auto_or_off(root: Path) -> None:
    assert load(root).resources.pipeline == "auto"
    for value, expected in (("auto", "auto"), (True, "auto"), ("on", "auto"), ("off", "off"),
                            (False, "off")):
        assert load(root, resources={"pipeline": value}).resources.pipeline == expected
    for word, expected in (("on", "auto"), ("off", "off")):  # YAML 1.1: bare booleans
        bare = root / f"bare-{word}.yaml"
        bare.write_text(write(root, merged(minimal())).read_text()
                        + f"resources:\n  pipeline: {word}\n")
        assert load_sweep_config(bare).resources.pipeline == expected
    assert (load(root, resources={"pipeline": "off"}).fingerprint()
            == load(root).fingerprint())


def test_update_on_is_auto_device_or_host(root: Path) -> None:
    assert load(root).resources.update_on == "auto"
    for value in ("device", "host"):
        config = load(root, resources={"update_on": value})
        assert config.resources.update_on == value
        assert config.fingerprint() == load(root).fingerprint()


def test_resources_are_not_part_of_the_sweep_identity(root: Path) -> None:
    first = load(root)
    moved = load(root, resources={"devices": "cpu:2x256MiB", "device_memory": "128MiB"})
    assert moved.canonical_text() == first.canonical_text()
    assert moved.fingerprint() == first.fingerprint()
    assert "resources" not in yaml.safe_load(first.canonical_text())
    assert moved.with_params({"train.lr": 0.1}).resources == moved.resources


def test_with_resources_overrides_and_names_the_option(root: Path) -> None:
    config = load(root, resources={"devices": "cpu:1x64MiB"})
    assert config.with_resources() is config
    changed = config.with_resources("cpu:2x1GiB", "512MiB")
    assert (changed.resources.devices, changed.resources.device_memory) == ("cpu:2x1GiB",
                                                                             "512MiB")
    assert changed.source == config.source and changed.train == config.train
    assert config.with_resources(device_memory="1GiB").resources.devices == "cpu:1x64MiB"
    with pytest.raises(ConfigError) as info:
        config.with_resources("tpu:0")
    assert str(info.value).startswith("--devices: expected a device spec")
    assert str(info.value).endswith("got 'tpu:0'")
    with pytest.raises(ConfigError, match=r"^--device-memory: expected a positive size"):
        config.with_resources(device_memory="-1")


def test_lion_is_an_optimizer_of_the_table_and_reads_betas(root: Path) -> None:
    config = load(root, train={"optimizer": "lion", "betas": [0.9, 0.99]},
                  parameters={"train.betas": {"values": ["0.9,0.99", "0.95,0.98"]}})
    assert config.train.optimizer == "lion"
    error(root, merged(minimal(), train={"optimizer": "sgd"},
                       parameters={"train.betas": {"values": ["0.9,0.99", "0.95,0.98"]}}),
          "parameters.train.betas", "train.optimizer: adamw or lion", "got 'sgd'")
