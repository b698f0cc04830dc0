"""The pre-launch checks and the data helpers they use, on the files shipped in examples/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sweepmaster.config import load_sweep_config, parse_sweep_config
from sweepmaster.config.preflight import ENVIRONMENT_SETTINGS, check_environment, check_sweep
from sweepmaster.errors import ConfigError, DataError, SettingError, StorageError
from sweepmaster.workload.text import (
    cached_tokenizer,
    check_utf8,
    count_tokens,
    find_splits,
    tokenize_files,
)
from tests.kit.sweeps import DATA, EXAMPLES, tiny_sweep, write_sweep

TOKENIZER = DATA / "gpt2-tokenizer"
SPLITS = find_splits(DATA / "wikitext-2-slice")


#: Examples for a server that reaches the HuggingFace hub (their model and data are downloaded).
HUB_EXAMPLES = ("gpt2-finetune.yaml",)


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")
                                           if p.name not in ("bad.yaml", *HUB_EXAMPLES)))
def test_every_example_passes(example: str) -> None:
    check_sweep(load_sweep_config(EXAMPLES / example))


@pytest.mark.parametrize(("files", "at_most"), [
    ([SPLITS["valid"]], 10**9),
    ([SPLITS["valid"]], 777),
    ([SPLITS["valid"], SPLITS["test"]], 10**9),
])
def test_count_tokens_counts_what_tokenize_files_gives(files: list[Path], at_most: int,
                                                       tmp_path: Path) -> None:
    ids_L = tokenize_files(files, TOKENIZER, cache_dir=tmp_path)
    assert count_tokens(files, cached_tokenizer(TOKENIZER), at_most) == min(ids_L.numel(),
                                                                            at_most)


@pytest.mark.parametrize(("data", "message"), [
    ("naïve".encode() + b"\n", None),
    (b"ok\n" + "naïve".encode("latin-1"), "not UTF-8: byte 0xef at offset 5"),
    (b"ok\n" + "é".encode()[:1], "ends inside a character"),
])
def test_check_utf8(data: bytes, message: str | None, tmp_path: Path) -> None:
    path = tmp_path / "text.txt"
    path.write_bytes(data)
    if message is None:
        check_utf8(path)
    else:
        with pytest.raises(DataError, match=message):
            check_utf8(path)


def test_every_grid_cell_is_checked_and_the_error_names_its_values(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, parameters={"model.config.n_embd": {"values": [48, 32]},
                                           "model.config.n_head": {"values": [2, 3]}})
    with pytest.raises(ConfigError) as info:
        check_sweep(parse_sweep_config(raw, "sweep.yaml"))
    assert str(info.value) == (
        "sweep.yaml: parameters.model.config.n_head: with model.config.n_embd=32, "
        "model.config.n_head=3: model.config.n_head: expected a divisor of n_embd (32): each "
        "head gets an equal share of the width, got 3")


def test_a_setting_no_parameter_changes_is_keyed_by_the_file(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, model={"config": {"n_layer": 1, "n_embd": 30, "n_head": 4,
                                                 "n_positions": 32}})
    with pytest.raises(ConfigError) as info:
        check_sweep(parse_sweep_config(raw, "sweep.yaml"))
    assert info.value.key == "model.config.n_head"


def test_the_base_batch_size_is_not_checked_when_the_grid_replaces_it(tmp_path: Path) -> None:
    """Only configurations a trial can get are checked: here the file's batch of 8 is not."""
    raw = tiny_sweep(tmp_path, data={"max_train_tokens": 70}, train={"batch_size": 8},
                     parameters={"train.batch_size": {"values": [1, 2]}})
    check_sweep(parse_sweep_config(raw, "sweep.yaml"))


def test_check_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWEEPMASTER_STORAGE_RETRY_S", "30")
    check_environment()
    monkeypatch.setenv("SWEEPMASTER_STORAGE_RETRY_S", "-1")
    with pytest.raises(StorageError, match="SWEEPMASTER_STORAGE_RETRY_S: expected a number"):
        check_environment()


def test_every_setting_read_is_known_and_no_other_sweepmaster_name_is_accepted() -> None:
    from sweepmaster.dashboard.server import TOKEN_ENV
    from sweepmaster.runtime.devices.budget import HEADROOM_ENV
    from sweepmaster.store.retry import RETRY_TIMEOUT_ENV, STATEMENT_TIMEOUT_ENV

    assert {TOKEN_ENV, HEADROOM_ENV, RETRY_TIMEOUT_ENV, STATEMENT_TIMEOUT_ENV} \
        < set(ENVIRONMENT_SETTINGS)
    check_environment()  # the tests' own environment sets no unknown name
    check_environment(dict.fromkeys(ENVIRONMENT_SETTINGS, "") | {"SWEEPMASTERS": "x"})
    with pytest.raises(SettingError, match="^environment variable SWEEPMASTER_DASHBORD_TOKEN: "
                       "not a sweepmaster setting [(]did you mean SWEEPMASTER_DASHBOARD_TOKEN[?]"):
        check_environment({"SWEEPMASTER_DASHBORD_TOKEN": "secret"})
    with pytest.raises(SettingError, match=r"SWEEPMASTER_X: not a sweepmaster setting \(known: "
                       "SWEEPMASTER_DASHBOARD_TOKEN, SWEEPMASTER_DEVICE_HEADROOM, "
                       "SWEEPMASTER_STORAGE, SWEEPMASTER_STORAGE_RETRY_S, "
                       r"SWEEPMASTER_STATEMENT_TIMEOUT_S\)$"):
        check_environment({"SWEEPMASTER_X": "1"})
    with pytest.raises(StorageError, match="SWEEPMASTER_STATEMENT_TIMEOUT_S: expected a "
                       "positive number of seconds, got '0'"):
        check_environment({"SWEEPMASTER_STATEMENT_TIMEOUT_S": "0"})


def test_a_pretrained_config_is_checked_like_a_written_one(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        '{"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64, '
        '"vocab_size": 100}')
    raw = tiny_sweep(tmp_path)
    raw["model"] = {"pretrained": str(model_dir)}
    with pytest.raises(ConfigError) as info:
        check_sweep(parse_sweep_config(raw, "sweep.yaml"))
    assert info.value.key == "model.pretrained"
    assert "config.json) vocab_size: expected at least the 50257 tokens" in str(info.value)


def test_validate_imports_neither_the_training_modules_nor_the_store_s_migrations() -> None:
    """The checks validate runs need the tokenizer and transformers' config classes, no more."""
    code = ("import sys\n"
            "from sweepmaster.config import load_sweep_config\n"
            "from sweepmaster.config.preflight import check_environment, check_sweep\n"
            "check_environment()\n"
            f"check_sweep(load_sweep_config({str(EXAMPLES / 'quickstart.yaml')!r}))\n"
            "print(sorted(m for m in ('alembic', 'sweepmaster.runtime.planning.fusion_degree',\n"
            "    'sweepmaster.runtime.training.plain', 'sweepmaster.store.models',\n"
            "    'sweepmaster.workload.causal_lm', 'transformers.modeling_utils')\n"
            "    if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=EXAMPLES.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def _validate_in_a_process(sweep: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *flags, "-m", "sweepmaster", "validate", str(sweep)],
                          capture_output=True, text=True, timeout=300, cwd=sweep.parent)


@pytest.mark.parametrize("example", ["quickstart.yaml", "sharp-cpu.yaml"])
def test_the_validate_command_does_not_import_torch(example: str) -> None:
    """``sweepmaster validate`` loads transformers without torch: no model is ever built.

    ``sharp-cpu.yaml`` names virtual devices (``cpu:2x256MiB``): the device-spec grammar is
    torch-free too.
    """
    result = _validate_in_a_process(EXAMPLES / example, "-X", "importtime")
    assert result.returncode == 0, result.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "transformers.configuration_utils" in imported  # the config classes were checked
    assert "torch" not in imported
    assert not any(name.startswith("torch.") for name in imported)


@pytest.mark.parametrize("model", [
    {"config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32,
                "activation_function": "gelu_neww"}},
    {"config": {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 30,
                "num_attention_heads": 4, "max_position_embeddings": 32}},
    {"config": {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 32,
                "num_attention_heads": 2, "max_position_embeddings": 32,
                "rope_parameters": {"rope_type": "yarm", "rope_theta": 10000.0}}},
    {"config": {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 32,
                "num_attention_heads": 2, "max_position_embeddings": 32},
     "peft": {"target_modules": ["c_attn"]}},
], ids=["activation", "heads", "rope", "lora-targets"])
def test_validate_without_torch_says_what_validate_with_torch_says(model: dict[str, Any],
                                                                   tmp_path: Path) -> None:
    """The same error line from the command (no torch) as from the app in this process."""
    from typer.testing import CliRunner

    from sweepmaster.cli import app

    sweep = write_sweep(tmp_path, tiny_sweep(tmp_path, model=model))
    result = _validate_in_a_process(sweep)
    assert result.returncode == 2, result.stderr
    in_process = CliRunner().invoke(app, ["validate", str(sweep)])
    assert in_process.exit_code == 2
    assert " ".join(result.stderr.split()) == " ".join(in_process.stderr.split())


@pytest.mark.parametrize(("model_type", "sizes"), [
    ("gpt2", {"n_layer": 2, "n_embd": 32, "n_head": 2}),
    ("llama", {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
               "intermediate_size": 64}),
    ("mistral", {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "intermediate_size": 64}),
    ("qwen2", {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
               "intermediate_size": 64}),
    ("gpt_neox", {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
                  "intermediate_size": 64}),
    ("opt", {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
             "ffn_dim": 64}),
    ("opt", {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
             "ffn_dim": 64, "word_embed_proj_dim": 16}),
])
def test_the_families_table_says_what_the_built_model_has(model_type: str,
                                                          sizes: dict[str, int]) -> None:
    """The facts validate takes from the table, against the model transformers builds."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.activations import ACT2FN
    from transformers.pytorch_utils import Conv1D

    from sweepmaster.config.trial_checks import linear_module_names
    from sweepmaster.workload.configs import model_config_from_mapping
    from sweepmaster.workload.families import ACTIVATIONS, FAMILIES

    family = FAMILIES[model_type]
    config = model_config_from_mapping({"model_type": model_type, **sizes}, 128)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linears = [name for name, module in model.named_modules()
               if isinstance(module, (torch.nn.Linear, Conv1D))]
    assert sorted(linear_module_names(family, config)) == sorted(linears)
    assert type(model).__name__ == family.model_class
    assert getattr(config, family.activation) in ACTIVATIONS
    assert ACTIVATIONS == tuple(sorted(ACT2FN))
