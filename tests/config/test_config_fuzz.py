"""Fuzzing the sweep.yaml loader: whatever the file holds, a SweepConfig or one ConfigError line.

Random YAML text, random YAML documents, and random mutations of a valid sweep.yaml (wrong
types, unknown keys, odd parameter specs, odd unicode, huge numbers, NaN, deep nesting, alias
bombs) must each either load or raise ``ConfigError`` whose message is one line starting with
the file's path. Any other exception is a bug in the loader.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sweepmaster.cli import app
from sweepmaster.config import SweepConfig, load_sweep_config
from sweepmaster.errors import ConfigError
from tests.kit.sweeps import tiny_sweep

FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

ODD_STRINGS = [
    "", " ", "\t", "\n", "\r\n", "\x00", "\x1b[31m", "\u2028", "\u202e", "\ufeff", "ü", "名前",
    "🙂", "[/]", "[bold]x", "{x}", "%s", "a" * 300, "1e-4", ".inf", ".nan", "null", "~", "yes",
    "0x1F", "grid", "tpe", "median", "adamw", "float16", "gpt2", "../..", "/dev/null",
    "sqlite://", "postgresql+psycopg://u:p@h/d", "train.lr", "model.config.n_layer",
]
KEYS = [
    "name", "storage", "study", "model", "data", "train", "resources", "output", "parameters",
    "direction", "metric", "sampler", "seed", "pruner", "n_trials", "type", "config",
    "pretrained", "dtype", "dir", "train_files", "valid_files", "tokenizer", "block_size",
    "max_train_tokens", "max_eval_tokens", "cache_dir", "epochs", "max_steps", "batch_size",
    "optimizer", "lr", "weight_decay", "betas", "momentum", "warmup_steps", "schedule",
    "grad_clip", "eval_every", "devices", "save", "value", "values", "min", "max", "q",
    "distribution", "n_layer", "n_embd", "n_head", "n_positions", "n_startup_trials",
    "n_warmup_steps", "train.lr", "train.batch_size", "model.config.n_layer", "data.block_size",
]

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, 1, -1, 2, 2**31, 2**63, 2**64, 10**300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e300, math.inf, -math.inf, math.nan]),
    st.text(max_size=12), st.sampled_from(ODD_STRINGS),
)
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=10), st.integers(-5, 5), st.none())
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(keys, inner, max_size=4)),
    max_leaves=16,
)
#: Values a user might plausibly write, so that mutations reach the checks past the schema.
plausible = st.one_of(
    st.integers(-3, 70), st.floats(-1.0, 2.0), st.sampled_from([1e-4, 3e-4, 0.999, 1e9]),
    st.sampled_from(["grid", "tpe", "random", "cmaes", "gp", "qmc", "median", "hyperband",
                     "successive_halving", "none", "minimize", "maximize", "eval_loss",
                     "train_loss", "adamw", "sgd", "cosine", "linear", "float16", "bfloat16",
                     "best", "all", "gpt2", "llama", "cpu", "auto"]),
    st.lists(st.integers(-2, 64), max_size=3), st.lists(st.floats(0, 1), max_size=3),
)
specs = st.dictionaries(st.sampled_from(["value", "values", "min", "max", "q", "distribution",
                                         "extra"]),
                        st.one_of(scalars, plausible, st.lists(scalars, max_size=4),
                                  st.sampled_from(["uniform", "int_uniform", "q_uniform",
                                                   "log_uniform_values", "categorical",
                                                   "constant", "normal"])),
                        max_size=4)


def check(path: Path) -> SweepConfig | None:
    """Load ``path``; a ConfigError must be one line naming the file. Returns the config."""
    try:
        config = load_sweep_config(path)
    except ConfigError as err:
        message = str(err)
        assert len(message.splitlines()) == 1, message
        assert message.startswith(f"{path}: "), message
        return None
    assert isinstance(config, SweepConfig)
    config.fingerprint()  # a loaded config can be hashed, dumped and re-validated
    return config


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@FUZZ
@given(text=st.one_of(
    st.text(max_size=200),
    st.text(alphabet=st.sampled_from(list(":-[]{}#&*!|>'\"%@`,?.~+e019 \n\t") + ["\x00", "ü",
                                                                                "\u2028"]),
            max_size=120),
))
def test_random_text(base_dir: Path, text: str) -> None:
    path = base_dir / "text.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    check(path)


@FUZZ
@given(document=st.dictionaries(keys, values, max_size=6) | values)
def test_random_documents(base_dir: Path, document: Any) -> None:
    path = base_dir / "document.yaml"
    path.write_text(yaml.safe_dump(document, allow_unicode=True), encoding="utf-8",
                    errors="surrogatepass")
    check(path)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path of a nested mapping (the mutation targets)."""
    found = [prefix]
    if isinstance(node, dict):
        for key, child in node.items():
            found += _paths(child, (*prefix, key))
    return found


@st.composite
def mutated_sweeps(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    raw = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(_paths(raw)))
        parent: Any = raw
        for key in target[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["set", "delete", "add", "spec", "nest"]))
        if not target:
            action = "add"
        if action == "set":
            parent[target[-1]] = draw(st.one_of(plausible, values))
        elif action == "delete":
            del parent[target[-1]]
        elif action == "add":
            node = raw if not target else parent[target[-1]]
            if isinstance(node, dict):
                node[draw(keys)] = draw(st.one_of(plausible, values))
        elif action == "spec":
            parameters = raw.get("parameters")
            parameters = parameters if isinstance(parameters, dict) else {}
            path = draw(st.one_of(keys, st.sampled_from([
                "train.lr", "train.batch_size", "train.epochs", "train.seed", "data.block_size",
                "model.config.n_layer", "model.config.n_head", "model.config.n_embd",
                "model.dtype", "train.optimizer", "data.tokenizer", "model.config.model_type"])))
            raw["parameters"] = {**parameters, path: draw(specs)}
        else:  # nest the value deeper than anyone would write it
            value: Any = parent[target[-1]]
            for _ in range(draw(st.integers(1, 40))):
                value = [value] if draw(st.booleans()) else {"x": value}
            parent[target[-1]] = value
    return raw


@pytest.fixture(scope="module")
def valid_sweep(base_dir: Path) -> dict[str, Any]:
    raw = tiny_sweep(base_dir)
    path = base_dir / "valid.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert check(path) is not None, "the base sweep must be valid"
    return raw


@FUZZ
@given(data=st.data())
def test_mutations_of_a_valid_sweep(base_dir: Path, valid_sweep: dict[str, Any],
                                    data: st.DataObject) -> None:
    raw = data.draw(mutated_sweeps(valid_sweep))
    try:
        text = yaml.safe_dump(raw, allow_unicode=True, sort_keys=False)
    except yaml.YAMLError:
        assume(False)  # not representable as YAML
    path = base_dir / "mutated.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    check(path)


@FUZZ
@given(key=st.sampled_from(KEYS + ["train.lr", "study.sampler", "x..y", ""]),
       value=st.text(max_size=30))
def test_set_overrides(base_dir: Path, valid_sweep: dict[str, Any], key: str,
                       value: str) -> None:
    path = base_dir / "valid.yaml"
    try:
        config = load_sweep_config(path, [f"{key}={value}"])
    except ConfigError as err:
        assert len(str(err).splitlines()) == 1 and str(err).startswith(f"{path}: "), str(err)
    else:
        assert isinstance(config, SweepConfig)


def test_nasty_documents_by_hand(base_dir: Path) -> None:
    """The cases the fuzzer found, kept as plain regression tests."""
    base = yaml.safe_dump(tiny_sweep(base_dir))
    cases = {
        "deep lists": ("[" * 5000 + "]" * 5000, "nested more than 32 levels deep"),
        "deep under a key": (base + "x: " + "[" * 40 + "]" * 40, "nested at most 32 levels"),
        "alias cycle": ("&a [*a]", "alias that contains itself"),
        "billion laughs": ("a: &a [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
            f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n"
            for p, n in zip("abcde", "bcdef", strict=True)), "at most 100000 values"),
        "two million values": ("values: [" + "1, " * 2_000_000 + "]\n",
                               "a YAML file of at most 262144 bytes"),
        "more values than a document holds": ("[" + "1," * 100_001 + "]",
                                              "a YAML document of at most 100000 values"),
        "NUL": ("name: \x00", "U+0000 at character 7"),
        "huge integer": ("a: " + "9" * 5000, "value has 5000 digits"),
        "duplicate section": (base + "train: {lr: 1}\n", "found duplicate key 'train'"),
        "newline in a key": (base + '"a\\nb": 1\n', "a\\nb: unknown key"),
        "infinite lr": (base.replace("lr: 0.01", "lr: .inf"), "train.lr: expected a finite"),
        "overflowing float": (base.replace("lr: 0.01", "lr: 1e400"), "finite number > 0"),
        "steps past the database": (base.replace("max_steps: 6", "max_steps: 4294967296"),
                                    "<= 2147483647"),
        "markup in a path": (base.replace("block_size: 32", "block_size: 32\n  dir2: '[/]'"),
                             "data.dir2: unknown key"),
    }
    for name, (text, fragment) in cases.items():
        path = base_dir / "nasty.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_sweep_config(path)
        assert fragment in str(info.value), (name, str(info.value))
        assert len(str(info.value).splitlines()) == 1, name


def test_markup_in_a_message_is_printed_as_text(base_dir: Path) -> None:
    from typer.testing import CliRunner

    raw = tiny_sweep(base_dir)
    raw["data"]["dir"] = "[/]not-there"
    path = base_dir / "markup.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    assert "[/]not-there" in result.stderr and len(result.stderr.splitlines()) == 1
