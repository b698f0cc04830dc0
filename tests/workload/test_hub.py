"""Hub ids in model.pretrained, data.tokenizer and TrainSpec.model, from an offline cache.

The cache is laid out as a download leaves it (:mod:`hub_cache`); ``HF_HUB_OFFLINE`` is set
(conftest), so nothing here reaches the network.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from sweepmaster.cli import app
from sweepmaster.config import load_sweep_config
from sweepmaster.config.preflight import check_sweep
from sweepmaster.config.train_specs import TokenData, prepare_data, train_spec_from_config
from sweepmaster.errors import ConfigError, DataError
from sweepmaster.sweep import run_sweep
from sweepmaster.workload import TrainSpec
from sweepmaster.workload.architecture import architecture_key
from sweepmaster.workload.causal_lm import build_model
from sweepmaster.workload.hub import Snapshot, resolve
from tests.kit.hub import MAIN_SHA, OTHER_SHA, REPO_ID, HubServer, make_hub_cache
from tests.kit.sweeps import tiny_sweep, write_sweep


@pytest.fixture(scope="module")
def _cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf_home = tmp_path_factory.mktemp("hf-home")
    make_hub_cache(hf_home)
    return hf_home


@pytest.fixture
def hf_home(_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``HF_HOME`` pointing at the laid-out cache, offline."""
    monkeypatch.setenv("HF_HOME", str(_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return _cache


def hub_sweep(tmp_path: Path, **model: Any) -> dict[str, Any]:
    """The tiny sweep over the cached model and its tokenizer: 2 trials of 4 steps."""
    raw = tiny_sweep(tmp_path, model={"config": None, "pretrained": REPO_ID, **model},
                     train={"max_steps": 4, "eval_every": 2})
    raw["data"]["tokenizer"] = REPO_ID
    raw["parameters"] = {"train.lr": {"values": [1e-2, 3e-3]}}
    return raw


def snapshot_dir(hf_home: Path, sha: str) -> Path:
    return hf_home / "hub" / "models--smtest--tiny-gpt2" / "snapshots" / sha


def test_a_sweep_over_a_cached_hub_model_and_tokenizer_completes(hf_home: Path,
                                                                 tmp_path: Path) -> None:
    config = load_sweep_config(write_sweep(tmp_path, hub_sweep(tmp_path)))
    assert config.model.pretrained == REPO_ID  # the file's text is kept
    assert config.pretrained_snapshot().path == snapshot_dir(hf_home, MAIN_SHA)
    assert config.tokenizer_snapshot().path == snapshot_dir(hf_home, MAIN_SHA)

    outcome = run_sweep(config)

    assert (outcome.num_run, outcome.num_finished, outcome.status) == (2, 2, "completed")
    data = prepare_data(config)
    assert data.vocab_size == 50257
    spec = train_spec_from_config(config, data)
    assert spec.model == str(snapshot_dir(hf_home, MAIN_SHA)) and spec.revision == MAIN_SHA
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(snapshot_dir(hf_home, MAIN_SHA))
    torch.manual_seed(0)
    built = build_model(spec.model)
    for (name, a), b in zip(built.state_dict().items(), saved.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name  # the cached weights, not a random init


def test_a_missing_id_offline_is_refused_naming_the_key(hf_home: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    raw = hub_sweep(tmp_path)
    raw["model"]["pretrained"] = "smtest/not-cached"
    path = write_sweep(tmp_path, raw)
    before = sorted(p.name for p in tmp_path.iterdir())

    result = CliRunner().invoke(app, ["launch", str(path)])

    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"error: {path}: model.pretrained: a model directory saved with "
                     "save_pretrained or a HuggingFace hub id, got smtest/not-cached (no such "
                     f"directory, and not in the HuggingFace cache {hf_home / 'hub'}, and "
                     "HF_HUB_OFFLINE is set: download it once online)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no database, no checkpoint


def test_a_missing_tokenizer_id_is_refused_naming_the_key(hf_home: Path,
                                                         tmp_path: Path) -> None:
    raw = hub_sweep(tmp_path)
    raw["data"]["tokenizer"] = "smtest/no-tokenizer"
    with pytest.raises(ConfigError) as info:
        load_sweep_config(write_sweep(tmp_path, raw))
    assert info.value.key == "data.tokenizer"
    assert "got smtest/no-tokenizer (no such directory, and not in" in str(info.value)


def test_a_revision_pins_a_commit(hf_home: Path, tmp_path: Path) -> None:
    main = load_sweep_config(write_sweep(tmp_path, hub_sweep(tmp_path), "main.yaml"))
    pinned = load_sweep_config(write_sweep(tmp_path, hub_sweep(tmp_path, revision=OTHER_SHA),
                                           "pinned.yaml"))
    check_sweep(pinned)
    assert pinned.pretrained_snapshot().path == snapshot_dir(hf_home, OTHER_SHA)
    assert pinned.tokenizer_snapshot().path == snapshot_dir(hf_home, OTHER_SHA)
    blocks = TokenData(torch.zeros(4, 32, dtype=torch.long), None, 50257)
    main_spec, pinned_spec = (train_spec_from_config(c, blocks) for c in (main, pinned))
    assert pinned_spec.revision == OTHER_SHA
    # Same shapes, other weights: the architecture key (and the plan cache) follow the commit.
    assert architecture_key(main_spec) != architecture_key(pinned_spec)
    torch.manual_seed(0)
    main_weight = build_model(main_spec.model).transformer.wte.weight
    pinned_weight = build_model(pinned_spec.model).transformer.wte.weight
    assert not torch.equal(main_weight, pinned_weight)


@pytest.mark.parametrize("revision", ["v2", "3" * 40])
def test_a_wrong_revision_is_refused(hf_home: Path, tmp_path: Path, revision: str) -> None:
    path = write_sweep(tmp_path, hub_sweep(tmp_path, revision=revision))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: model.revision: "), lines
    assert f"{REPO_ID}@{revision} (the HuggingFace cache" in lines[0]


def test_a_revision_with_a_local_directory_is_refused(hf_home: Path, tmp_path: Path) -> None:
    raw = hub_sweep(tmp_path, revision=MAIN_SHA)
    raw["model"]["pretrained"] = str(snapshot_dir(hf_home, MAIN_SHA))
    with pytest.raises(ConfigError, match="model.revision: only with a HuggingFace hub id"):
        load_sweep_config(write_sweep(tmp_path, raw))


def test_train_spec_takes_a_hub_id(hf_home: Path) -> None:
    blocks = torch.zeros(4, 16, dtype=torch.long)
    spec = TrainSpec(model=REPO_ID, train_data=blocks, batch_size=2, revision=OTHER_SHA)
    assert spec.model == str(snapshot_dir(hf_home, OTHER_SHA)) and spec.revision == OTHER_SHA
    with pytest.raises(DataError, match=r"^TrainSpec\.model: .*got smtest/gone \(no such "):
        TrainSpec(model="smtest/gone", train_data=blocks, batch_size=2)
    with pytest.raises(DataError, match=r"^TrainSpec\.revision: "):
        TrainSpec(model=REPO_ID, train_data=blocks, batch_size=2, revision="nope")
    with pytest.raises(ValueError, match="TrainSpec.revision is only for a hub id"):
        TrainSpec(model=str(snapshot_dir(hf_home, MAIN_SHA)), train_data=blocks, batch_size=2,
                  revision=OTHER_SHA)
    again = dataclasses.replace(spec, name="again")  # a resolved spec copies as it is
    assert (again.model, again.revision) == (spec.model, spec.revision)


def test_an_id_is_resolved_once_per_process(hf_home: Path) -> None:
    first = resolve(REPO_ID)
    ref = hf_home / "hub" / "models--smtest--tiny-gpt2" / "refs" / "main"
    ref.write_text(OTHER_SHA)  # the branch moves while a sweep runs
    try:
        assert resolve(REPO_ID) == first  # its trials keep training the commit it began with
        assert first.revision == MAIN_SHA
    finally:
        ref.write_text(MAIN_SHA)


def test_hub_keys_at_their_defaults_leave_the_sweep_text_as_it_was(hf_home: Path,
                                                                  tmp_path: Path) -> None:
    import json

    plain = load_sweep_config(write_sweep(tmp_path, tiny_sweep(tmp_path), "plain.yaml"))
    model = json.loads(plain.canonical_text())["model"]
    assert {"revision", "trust_remote_code"}.isdisjoint(model)
    pinned = load_sweep_config(write_sweep(tmp_path, hub_sweep(tmp_path, revision=OTHER_SHA)))
    assert json.loads(pinned.canonical_text())["model"]["revision"] == OTHER_SHA


def test_build_model_takes_a_hub_id(hf_home: Path) -> None:
    model = build_model(REPO_ID)
    saved = build_model(str(snapshot_dir(hf_home, MAIN_SHA)))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved.parameters(),
                                                 strict=True))


@pytest.fixture
def online_hub(_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
               ) -> Iterator[HubServer]:
    """Online, an empty local cache, and a local stand-in of the hub serving ``_cache``'s repos.

    ``HF_ENDPOINT`` is read when huggingface_hub is imported: its constants are set as it
    would have set them.
    """
    from huggingface_hub import constants

    server = HubServer(_cache)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", "")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        server.url + "/{repo_id}/resolve/{revision}/{filename}")
    try:
        yield server
    finally:
        server.close()


def test_an_id_not_cached_is_downloaded_once_then_runs_offline(
        online_hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "hf-home" / "hub" / "models--smtest--tiny-gpt2"
    config = load_sweep_config(write_sweep(tmp_path, hub_sweep(tmp_path)))
    snapshot = config.pretrained_snapshot()

    assert snapshot == Snapshot(local / "snapshots" / MAIN_SHA, MAIN_SHA)
    assert (local / "refs" / "main").read_text() == MAIN_SHA  # a later offline run finds it
    files = sorted(p.name for p in snapshot.path.iterdir())
    assert "model.safetensors" in files and "vocab.json" in files and "config.json" in files
    downloads = [r for r in online_hub.requests if r.startswith("GET /smtest/")]
    assert len(downloads) == len(files)  # each file once, the tokenizer's with the model's
    assert not any(r.endswith(".bin") for r in online_hub.requests)  # one weight format

    online_hub.close()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = load_sweep_config(write_sweep(tmp_path, hub_sweep(tmp_path), "again.yaml"))
    check_sweep(again)
    assert again.pretrained_snapshot() == snapshot


@pytest.mark.parametrize(("name", "revision", "key", "fragment"), [
    ("smtest/unknown", None, "model.pretrained",
     "got smtest/unknown (no such model on the HuggingFace hub, or a private one"),
    ("smtest/gated", None, "model.pretrained",
     "got smtest/gated (a gated model: accept its terms on huggingface.co"),
    (REPO_ID, "v9", "model.revision", f"got {REPO_ID}@v9 (no such revision on the HuggingFace "
                                      "hub)"),
])
def test_what_the_hub_refuses_is_refused_naming_the_key(online_hub: HubServer, tmp_path: Path,
                                                        name: str, revision: str | None,
                                                        key: str, fragment: str) -> None:
    raw = hub_sweep(tmp_path, pretrained=name, revision=revision)
    raw["data"]["tokenizer"] = tiny_sweep(tmp_path)["data"]["tokenizer"]
    with pytest.raises(ConfigError) as info:
        load_sweep_config(write_sweep(tmp_path, raw))
    assert info.value.key == key and fragment in str(info.value), str(info.value)


def test_the_gpt2_finetune_example_loads_over_a_cached_gpt2(hf_home: Path) -> None:
    """examples/gpt2-finetune.yaml's keys, its hub id resolved from a laid-out cache."""
    from tests.kit.data import ROOT

    make_hub_cache(hf_home, "gpt2", seeds=(0,))
    config = load_sweep_config(ROOT / "examples" / "gpt2-finetune.yaml",
                               ["data.block_size=64"])  # the tiny stand-in's n_positions
    snapshot = hf_home / "hub" / "models--gpt2" / "snapshots" / MAIN_SHA
    assert config.pretrained_snapshot() == Snapshot(snapshot, MAIN_SHA)
    assert config.tokenizer_snapshot() == Snapshot(snapshot, MAIN_SHA)
    assert (config.data.dataset, config.data.config_name) == ("Salesforce/wikitext",
                                                              "wikitext-2-raw-v1")
    assert config.output.report_to == ["tensorboard"]
