"""Data through HuggingFace datasets: formats, loss masks, packing, cache, refusals, a sweep."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from sweepmaster.cli import app
from sweepmaster.config import load_sweep_config
from sweepmaster.errors import ConfigError
from sweepmaster.workload.hfdata import prepare_dataset
from sweepmaster.workload.text import load_tokenizer
from tests.kit.data import ROOT as REPO

EXAMPLES = REPO / "examples"
TOKENIZER = EXAMPLES / "data" / "gpt2-tokenizer"
ARITHMETIC = EXAMPLES / "data" / "arithmetic"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROWS = [{"prompt": "2 + 3 =", "completion": " 5"}, {"prompt": "10 - 4 =", "completion": " 6"},
        {"prompt": "7 + 7 =", "completion": " 14"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(TOKENIZER)


def settings(tmp_path: Path, **values: Any) -> SimpleNamespace:
    """A ``data`` section (DataSettings) over JSON lines of ``ROWS``, its caches in tmp_path."""
    base = {"dataset": "json", "config_name": None, "train_split": "train", "eval_split": None,
            "eval_fraction": None, "text_field": None, "prompt_field": None,
            "completion_field": None, "messages_field": None, "packing": False,
            "block_size": 12, "max_train_tokens": None, "max_eval_tokens": None,
            "cache_dir": tmp_path / "cache"}
    if "data_files" not in values:
        write_rows(tmp_path / "train.jsonl", ROWS)
        values["data_files"] = {"train": str(tmp_path / "train.jsonl")}
    base.update(values)
    return SimpleNamespace(**base)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_prompt_completion_rows_count_the_completion_and_eos_only(tmp_path, tokenizer) -> None:
    blocks = prepare_dataset(settings(tmp_path), tokenizer, "sweep.yaml")
    eos = tokenizer.eos_token_id
    assert blocks.train.shape == blocks.train_mask.shape == (3, 12)
    assert blocks.train.dtype == torch.int64 and blocks.train_mask.dtype == torch.bool
    for row, ids, mask in zip(ROWS, blocks.train, blocks.train_mask, strict=True):
        prompt = tokenizer(row["prompt"])["input_ids"]
        completion = tokenizer(row["completion"])["input_ids"] + [eos]
        length = len(prompt) + len(completion)
        assert ids[:length].tolist() == prompt + completion
        assert mask.tolist() == [False] * len(prompt) + [True] * len(completion) + \
            [False] * (12 - length)
        assert ids[length:].tolist() == [eos] * (12 - length)  # padding: EOS, not counted
        assert tokenizer.decode(ids[mask]) == row["completion"] + "<|endoftext|>"
    assert blocks.valid is None and blocks.valid_mask is None


def test_packing_concatenates_the_examples_into_blocks(tmp_path, tokenizer) -> None:
    data = settings(tmp_path)
    padded = prepare_dataset(data, tokenizer, "sweep.yaml")
    packed = prepare_dataset(settings(tmp_path, packing=True, block_size=4,
                                      data_files=data.data_files), tokenizer, "sweep.yaml")
    lengths = [int((row != tokenizer.eos_token_id).sum()) + 1 for row in padded.train]
    flat = torch.cat([row[:n] for row, n in zip(padded.train, lengths, strict=True)])
    flat_mask = torch.cat([row[:n] for row, n in zip(padded.train_mask, lengths, strict=True)])
    num_blocks = len(flat) // 4
    keep = flat_mask[: num_blocks * 4].reshape(num_blocks, 4)[:, 1:].any(dim=1)
    assert torch.equal(packed.train, flat[: num_blocks * 4].reshape(num_blocks, 4)[keep])
    assert torch.equal(packed.train_mask, flat_mask[: num_blocks * 4].reshape(num_blocks, 4)[keep])
    assert not keep.all()  # a block of prompt tokens only is dropped: nothing to average


def test_tokenized_splits_are_cached_keyed_by_tokenizer_and_fields(tmp_path, tokenizer) -> None:
    data = settings(tmp_path)
    tokenized: list[str] = []
    first = prepare_dataset(data, tokenizer, "sweep.yaml", lambda: tokenized.append("first"))
    again = prepare_dataset(settings(tmp_path, packing=True, block_size=4,
                                     data_files=data.data_files),
                            tokenizer, "sweep.yaml", lambda: tokenized.append("again"))
    assert tokenized == ["first"]  # a relaunch (or another block layout) reads the cache
    assert len(list((tmp_path / "cache" / "datasets").glob("tokens-*.arrow"))) == 1
    assert again.train.numel() > 0
    other = load_tokenizer(TOKENIZER)
    other.chat_template = CHATML  # another tokenizer: tokenized again
    prepare_dataset(data, other, "sweep.yaml", lambda: tokenized.append("tokenizer"))
    write_rows(tmp_path / "train.jsonl", [{"prompt": "1 + 1 =", "completion": " 2"}])
    changed = prepare_dataset(data, tokenizer, "sweep.yaml", lambda: tokenized.append("file"))
    assert tokenized == ["first", "tokenizer", "file"]
    assert changed.train.shape[0] == 1 and not torch.equal(changed.train, first.train[:1])


def test_chat_rows_count_the_assistant_turns_only(tmp_path, tokenizer) -> None:
    chat = load_tokenizer(TOKENIZER)
    chat.chat_template = CHATML
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2 + 3"},
                {"role": "assistant", "content": "5"}, {"role": "user", "content": "1 + 1"},
                {"role": "assistant", "content": "2"}]
    files = {"train": str(write_rows(tmp_path / "chat.jsonl", [{"messages": messages}]))}
    blocks = prepare_dataset(settings(tmp_path, data_files=files, block_size=128), chat,
                             "sweep.yaml")
    ids, mask = blocks.train[0], blocks.train_mask[0]
    text = chat.apply_chat_template(messages, tokenize=False)
    assert chat.decode(ids[: len(chat(text)["input_ids"])]) == text
    assert chat.decode(ids[mask]) == "5<|im_end|>\n2<|im_end|>\n"
    with pytest.raises(ConfigError, match="data.messages_field: a tokenizer with a chat "):
        prepare_dataset(settings(tmp_path, data_files=files), tokenizer, "sweep.yaml")


def test_a_save_to_disk_folder_and_a_held_out_fraction(tmp_path, tokenizer) -> None:
    import datasets

    rows = [{"text": f"line {i} of the text"} for i in range(20)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    data = settings(tmp_path, dataset=str(tmp_path / "saved"), data_files=None,
                    eval_fraction=0.25, packing=False, block_size=8)
    blocks = prepare_dataset(data, tokenizer, "sweep.yaml")
    assert blocks.valid is not None and blocks.valid_mask is not None
    assert (blocks.train.shape[0], blocks.valid.shape[0]) == (15, 5)
    lengths = blocks.train_mask.sum(dim=1)  # text: every token but the padding counts
    assert all(bool(mask[:n].all()) for mask, n in zip(blocks.train_mask, lengths, strict=True))


@pytest.mark.parametrize(("change", "key", "fragment"), [
    ({"prompt_field": "question", "completion_field": "completion"}, "data.prompt_field",
     "a column of the rows"),
    ({"text_field": "body"}, "data.text_field", "a column of the rows"),
    ({"eval_split": "validation"}, "data.eval_split", "a split of the dataset"),
    ({"dataset": "no-such-builder-or-dataset", "data_files": None}, "data.dataset",
     "can be loaded"),
    ({"data_files": {"train": "/nonexistent/train.jsonl"}}, "data.data_files", "no such file"),
    ({"block_size": 2}, "data.train_split", "holding a target"),
])
def test_bad_datasets_are_refused_naming_the_key(tmp_path, tokenizer, change, key,
                                                 fragment, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ConfigError) as caught:
        prepare_dataset(settings(tmp_path, **change), tokenizer, "sweep.yaml")
    assert caught.value.key == key and fragment in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("builder", "text", "split", "key"), [
    ("json", "", "train", "data.train_split"),
    ("json", "\n\n", "train", "data.train_split"),
    ("csv", "prompt,completion\n", "train", "data.train_split"),
    ("json", "", "validation", "data.eval_split"),
])
def test_a_split_of_empty_files_is_refused_naming_its_key(tmp_path, tokenizer, builder, text,
                                                          split, key) -> None:
    empty = tmp_path / f"empty.{builder}"
    empty.write_text(text)
    files = {"train": str(write_rows(tmp_path / "rows.jsonl", ROWS)), split: str(empty)}
    with pytest.raises(ConfigError) as caught:
        prepare_dataset(settings(tmp_path, dataset=builder, data_files=files,
                                 eval_split="validation" if split == "validation" else None),
                        tokenizer, "sweep.yaml")
    assert caught.value.key == key, caught.value
    assert f"a split with rows, got an empty {split!r} split" in str(caught.value)


def test_a_data_file_as_the_dataset_is_refused_with_the_builder_to_name(
        tmp_path, tmp_path_factory) -> None:
    """``dataset: data/train.jsonl`` (next to the sweep file) names the builder form to write."""
    path, sets = sft_sweep(tmp_path, tmp_path_factory.mktemp("cache"))
    write_rows(tmp_path / "rows.jsonl", ROWS)
    config = load_sweep_config(path, [*sets, "data.dataset=rows.jsonl", "data.data_files=null",
                                      "data.eval_split=null", "study.metric=train_loss"])
    with pytest.raises(ConfigError) as caught:
        prepare_dataset(config.data, tokenizer=None, source=str(path))
    assert caught.value.key == "data.dataset"
    assert (f"got the data file {tmp_path / 'rows.jsonl'} (write dataset: json, data_files: "
            f"{{train: {tmp_path / 'rows.jsonl'}}})") in str(caught.value), caught.value


@pytest.mark.parametrize("name", ["data/missing.jsonl", "missing.csv", "/nonexistent/rows"])
def test_a_dataset_path_that_does_not_exist_is_refused_as_no_such_file(tmp_path, tokenizer,
                                                                     name) -> None:
    """Not taken for a hub id (which would ask the hub, online for half a minute of retries)."""
    with pytest.raises(ConfigError) as caught:
        prepare_dataset(settings(tmp_path, dataset=name, data_files=None), tokenizer,
                        "sweep.yaml")
    assert caught.value.key == "data.dataset"
    assert str(caught.value).endswith(f"got {name!r}: no such file or folder (relative to the "
                                      "sweep file)"), caught.value


def sft_sweep(tmp_path: Path, cache: Path, **data: Any) -> tuple[Path, list[str]]:
    """examples/sft-lora.yaml made tiny: a saved 1-layer GPT-2, 4 steps, one trial, caches apart.

    Returns the sweep file and its ``--set`` overrides."""
    from transformers import GPT2Config, GPT2LMHeadModel

    pretrained = tmp_path / "gpt2-tiny"
    if not pretrained.is_dir():
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16)) \
            .save_pretrained(pretrained)
    text = (EXAMPLES / "sft-lora.yaml").read_text()
    for old, new in (("data/arithmetic", str(ARITHMETIC)), ("data/gpt2-tokenizer",
                                                            str(TOKENIZER))):
        text = text.replace(old, new)
    path = tmp_path / "sft.yaml"
    path.write_text(text)
    sets = [f"storage=sqlite:///{tmp_path / 'sweep.db'}", "model.config=null",
            f"model.pretrained={pretrained}", "train.max_steps=4", "train.eval_every=2",
            "train.batch_size=8", f"output.dir={tmp_path / 'checkpoints'}",
            "parameters={model.peft.r: {values: [4]}}", f"data.cache_dir={cache}",
            *(f"data.{key}={value}" for key, value in data.items())]
    return path, sets


def test_a_tiny_sft_lora_sweep_completes_with_a_completion_only_objective(
        tmp_path, tmp_path_factory) -> None:
    from sweepmaster.config.train_specs import prepare_data, train_spec_from_config
    from sweepmaster.sweep import run_sweep

    path, sets = sft_sweep(tmp_path, tmp_path_factory.mktemp("cache"))
    config = load_sweep_config(path, sets)
    assert config.data.dataset == "json" and config.data.prompt_field == "prompt"
    assert config.data.data_files == {"train": str(ARITHMETIC / "train.jsonl"),
                                      "validation": str(ARITHMETIC / "valid.jsonl")}
    outcome = run_sweep(config)
    assert outcome.status == "completed" and outcome.num_finished == 1
    spec = train_spec_from_config(config.with_params({"model.peft.r": 4}),
                                  prepare_data(config))
    assert spec.train_mask is not None and spec.eval_mask is not None
    assert spec.peft is not None and spec.train_data.shape == (400, 16)
    # the objective counts the answers: well under half the tokens of a row
    assert 0 < int(spec.eval_mask.sum()) < spec.eval_data.numel() // 2
    assert outcome.best_value is not None and 0 < outcome.best_value < 20


def test_a_sweep_over_a_hub_cached_model_and_tokenizer_and_prompt_completion_lines(
        tmp_path, tmp_path_factory, monkeypatch) -> None:
    """The hub id in data.tokenizer is the cached snapshot's tokenizer for data.dataset too."""
    from sweepmaster.config.train_specs import prepare_data
    from sweepmaster.sweep import run_sweep
    from tests.kit.hub import REPO_ID, make_hub_cache

    hf_home = tmp_path_factory.mktemp("hf-home")
    make_hub_cache(hf_home, seeds=(0,))
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path, sets = sft_sweep(tmp_path, tmp_path_factory.mktemp("cache"))
    config = load_sweep_config(path, [*sets, f"model.pretrained={REPO_ID}",
                                      f"data.tokenizer={REPO_ID}"])
    outcome = run_sweep(config)
    assert (outcome.status, outcome.num_finished) == ("completed", 1), outcome
    data = prepare_data(config)
    assert data.valid_mask is not None and 0 < int(data.valid_mask.sum()) < \
        data.valid_mask.numel() // 2  # the objective counts the answers only


@pytest.mark.parametrize(("sets", "fragment"), [
    (["data.completion_field=answer"], "data.completion_field: a column of the rows"),
    (["data.prompt_field=null", "data.completion_field=null", "data.messages_field=messages"],
     "data.messages_field: a column of the rows"),
    (["data.eval_split=test"], "data.eval_split: a split of the dataset"),
    (["data.eval_split=null"], "study.metric: train_loss, or data.eval_split"),
    (["data.text_field=text"], "data.prompt_field: one format"),
    (["data.data_files={train: missing.jsonl}", "data.eval_split=null",
      "study.metric=train_loss"], "data.data_files: existing files"),
    (["data.prompt_field=null", "data.completion_field=null", "data.text_field=body"],
     "data.text_field: a column of the rows"),
    (["data.data_files={train: {tmp}/empty.jsonl, validation: {tmp}/chat.jsonl}"],
     "data.train_split: a split with rows, got an empty 'train' split"),
    (["data.data_files={train: {tmp}/chat.jsonl}", "data.eval_split=null",
      "study.metric=train_loss", "data.prompt_field=null", "data.completion_field=null",
      "data.messages_field=messages"], "data.messages_field: a tokenizer with a chat template"),
    (["data.dataset=data/missing.jsonl", "data.data_files=null", "data.eval_split=null",
      "study.metric=train_loss"], "got 'data/missing.jsonl': no such file or folder"),
    (["model.pretrained=no-such-org/no-such-model"],
     "model.pretrained: a model directory saved with save_pretrained or a HuggingFace hub id, "
     "got no-such-org/no-such-model (no such directory, and not in the HuggingFace cache"),
    (["output.report_to=[nosuch]"], "output.report_to.0: expected one of 'tensorboard'"),
    (["data.eval_split=null", "data.eval_fraction=1.5"],
     "data.eval_fraction: expected a number > 0 and < 1"),
    (["data.completion_field=null"], "data.completion_field: a column name beside "
     "data.prompt_field (prompt-completion rows need both), got none"),
])
def test_launch_refuses_a_bad_dataset_in_one_line_and_writes_nothing(
        tmp_path, tmp_path_factory, sets, fragment) -> None:
    """HF_HUB_OFFLINE is set (conftest): an id not in the cache is not downloaded."""
    path, base = sft_sweep(tmp_path, tmp_path_factory.mktemp("cache"))
    (tmp_path / "empty.jsonl").write_text("")
    write_rows(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "2 + 3"},
                                                       {"role": "assistant", "content": "5"}]}])
    sets = [s.replace("{tmp}", str(tmp_path)) for s in sets]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    result = CliRunner().invoke(app, ["launch", str(path), *(f"--set={s}" for s in base + sets)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no database, no checkpoint


@pytest.mark.slow
def test_a_hub_dataset_the_hub_does_not_answer_is_one_line(tmp_path, tmp_path_factory) -> None:
    """Online with the hub unreachable: datasets retries for half a minute, not a line each."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:  # a port nothing listens on: every request is refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    path, sets = sft_sweep(tmp_path, tmp_path_factory.mktemp("cache"))
    sets += ["data.dataset=smtest/unreachable", "data.data_files=null", "data.eval_split=null",
             "study.metric=train_loss"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80", "HF_HUB_OFFLINE": "0",
           "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf-home")}
    result = subprocess.run([sys.executable, "-m", "sweepmaster", "validate", str(path),
                             *(f"--set={s}" for s in sets)], cwd=tmp_path,
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "data.dataset: " in result.stderr and "smtest/unreachable" in result.stderr


def test_the_example_validates(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copytree(EXAMPLES, tmp_path / "examples", ignore=shutil.ignore_patterns("*.db"))
    config = load_sweep_config(tmp_path / "examples" / "sft-lora.yaml")
    assert config.data.packing is False and config.model.peft is not None


def test_right_padding_needs_no_attention_mask(tmp_path, tokenizer) -> None:
    """Padded rows (packing: false): transformers' loss with the attention mask equals the
    loss without it, the one every path computes, so no attention mask is carried."""
    from transformers import GPT2Config, GPT2LMHeadModel

    blocks = prepare_dataset(settings(tmp_path), tokenizer, "sweep.yaml")
    lengths = [len(tokenizer(r["prompt"] + r["completion"])["input_ids"]) + 1 for r in ROWS]
    attention = torch.arange(12) < torch.tensor(lengths)[:, None]
    assert not attention.all()  # the rows are padded
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16)).eval()
    labels = blocks.train.masked_fill(~blocks.train_mask, -100)
    with torch.no_grad():
        masked = model(input_ids=blocks.train, attention_mask=attention.long(), labels=labels)
        unmasked = model(input_ids=blocks.train, labels=labels)
    torch.testing.assert_close(masked.loss, unmasked.loss, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("sets", "key", "fragment"), [
    (["data.dataset=null", f"data.dir={EXAMPLES / 'data' / 'wikitext-2-slice'}"],
     "data.data_files", "only with data.dataset"),
    (["data.dataset=null", "data.data_files=null", "data.eval_split=null",
      f"data.dir={EXAMPLES / 'data' / 'wikitext-2-slice'}"], "data.prompt_field",
     "only with data.dataset"),
    (["data.eval_fraction=0.1"], "data.eval_fraction", "not with data.eval_split"),
    (["data.completion_field=null"], "data.completion_field", "need both"),
    (["data.eval_fraction=1.5", "data.eval_split=null"], "data.eval_fraction", "> 0 and < 1"),
    ([f"data.train_files=[{ARITHMETIC / 'train.jsonl'}]"], "data", "got both"),
])
def test_dataset_keys_are_checked_when_the_file_loads(tmp_path, tmp_path_factory, sets, key,
                                                       fragment) -> None:
    path, base = sft_sweep(tmp_path, tmp_path_factory.mktemp("cache"))
    with pytest.raises(ConfigError) as caught:
        load_sweep_config(path, [*base, *sets])
    assert caught.value.key == key and fragment in str(caught.value), caught.value
