from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config

from sweepmaster.errors import ConfigError, DataError
from sweepmaster.workload import (
    LoraSpec,
    build_model,
    causal_lm_loss,
    find_splits,
    lm_logits,
    load_tokenizer,
    make_blocks,
    model_config_from_mapping,
    save_weights,
    tokenize_files,
)
from sweepmaster.workload import text as text_module
from sweepmaster.workload.causal_lm import placeholder_init
from tests.kit.data import TOKENIZER_DIR, WIKITEXT_DIR
from tests.kit.models import tiny_gpt2 as tiny_config

TEXT_A = " = Heading = \n \n The quick brown fox jumps over the lazy dog . \n" * 40
TEXT_B = " Another file , with 12 @,@ 345 numbers and <unk> words . \n" * 30


# ---------------------------------------------------------------- find_splits


def test_find_splits_prefers_tokens_then_raw(tmp_path: Path) -> None:
    for name in ("wiki.train.tokens", "wiki.train.raw", "wiki.valid.raw"):
        (tmp_path / name).write_text("x\n")
    splits = find_splits(tmp_path)
    assert splits == {
        "train": tmp_path / "wiki.train.tokens",
        "valid": tmp_path / "wiki.valid.raw",
    }


def test_find_splits_includes_test_when_present(tmp_path: Path) -> None:
    for split in ("train", "valid", "test"):
        (tmp_path / f"wiki.{split}.tokens").write_text("x\n")
    assert set(find_splits(tmp_path)) == {"train", "valid", "test"}


def test_find_splits_missing_names_directory_and_files(tmp_path: Path) -> None:
    (tmp_path / "wiki.train.tokens").write_text("x\n")
    with pytest.raises(DataError) as info:
        find_splits(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "wiki.valid.tokens" in message and "wiki.valid.raw" in message
    assert "wiki.train" not in message


def test_find_splits_on_wikitext() -> None:
    splits = find_splits(WIKITEXT_DIR)
    assert splits["train"].name == "wiki.train.tokens"
    assert splits["test"].name == "wiki.test.tokens"


# ---------------------------------------------------------------- tokenizer


def test_load_tokenizer_missing_or_unusable(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="cannot load"):
        load_tokenizer(tmp_path / "empty")


def test_load_tokenizer_gpt2() -> None:
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    assert len(tokenizer) == 50257
    assert tokenizer.eos_token_id == 50256


@pytest.fixture
def text_files(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TEXT_A)
    b.write_text(TEXT_B)
    return a, b


def test_tokenize_files_concatenates_with_eos(text_files, tmp_path: Path) -> None:
    a, b = text_files
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    expected = (
        tokenizer(TEXT_A, add_special_tokens=False)["input_ids"]
        + [tokenizer.eos_token_id]
        + tokenizer(TEXT_B, add_special_tokens=False)["input_ids"]
    )
    ids = tokenize_files([a, b], TOKENIZER_DIR, cache_dir=tmp_path / "cache")
    assert ids.dtype == torch.int32 and ids.dim() == 1
    assert ids.tolist() == expected


def test_tokenize_files_cache_hit_does_not_retokenize(
    text_files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    first = tokenize_files(text_files, TOKENIZER_DIR, cache_dir=cache)
    (cache_file,) = cache.glob("*.pt")
    mtime_ns = cache_file.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("re-tokenized despite a valid cache file")

    monkeypatch.setattr(text_module, "_tokenize_uncached", fail)
    second = tokenize_files(text_files, TOKENIZER_DIR, cache_dir=cache)
    assert torch.equal(first, second)
    assert cache_file.stat().st_mtime_ns == mtime_ns
    assert list(cache.iterdir()) == [cache_file]  # no temp files left behind


def test_tokenize_files_cache_key_follows_file_and_max_tokens(text_files, tmp_path) -> None:
    a, _ = text_files
    cache = tmp_path / "cache"
    tokenize_files([a], TOKENIZER_DIR, cache_dir=cache)
    tokenize_files([a], TOKENIZER_DIR, max_tokens=7, cache_dir=cache)
    assert len(list(cache.glob("*.pt"))) == 2
    a.write_text(TEXT_B)
    ids = tokenize_files([a], TOKENIZER_DIR, cache_dir=cache)
    assert len(list(cache.glob("*.pt"))) == 3
    assert torch.equal(ids, tokenize_files([text_files[1]], TOKENIZER_DIR, cache_dir=cache))


def test_tokenize_files_default_cache_dir_uses_xdg(text_files, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    tokenize_files([text_files[0]], TOKENIZER_DIR)
    assert len(list((tmp_path / "xdg" / "sweepmaster" / "tokens").glob("*.pt"))) == 1


def test_tokenize_files_max_tokens_is_exact_prefix_and_stops_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = tmp_path / "big.txt"
    big.write_text(TEXT_A * 20)  # 2,400 lines: many line-chunks
    full = tokenize_files([big], TOKENIZER_DIR, cache_dir=tmp_path / "c1")

    seen_chars: list[int] = []
    real_load = text_module.load_tokenizer

    def counting_load(directory):
        tokenizer = real_load(directory)

        def encode(batch, **kwargs):
            seen_chars.append(sum(len(chunk) for chunk in batch))
            return tokenizer(batch, **kwargs)

        encode.eos_token_id = tokenizer.eos_token_id
        return encode

    monkeypatch.setattr(text_module, "load_tokenizer", counting_load)
    monkeypatch.setattr(text_module, "_LINES_PER_CHUNK", 8)
    monkeypatch.setattr(text_module, "_CHUNKS_PER_CALL", 2)
    head = tokenize_files([big], TOKENIZER_DIR, max_tokens=100, cache_dir=tmp_path / "c2")
    assert head.shape == (100,)
    assert torch.equal(head, full[:100])
    assert sum(seen_chars) < len(big.read_text()) / 2  # stopped long before the end


def test_tokenize_files_max_tokens_beyond_text_keeps_all(text_files, tmp_path) -> None:
    a, _ = text_files
    full = tokenize_files([a], TOKENIZER_DIR, cache_dir=tmp_path / "c")
    assert torch.equal(
        tokenize_files([a], TOKENIZER_DIR, max_tokens=10**9, cache_dir=tmp_path), full
    )


def test_tokenize_files_corrupt_cache_is_remade(text_files, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = tokenize_files(text_files, TOKENIZER_DIR, cache_dir=cache)
    (cache_file,) = cache.glob("*.pt")
    cache_file.write_bytes(b"\x00garbage, not a torch file")
    second = tokenize_files(text_files, TOKENIZER_DIR, cache_dir=cache)
    assert torch.equal(first, second)
    assert torch.equal(torch.load(cache_file, weights_only=True), first)


def test_tokenize_files_missing_inputs(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        tokenize_files([tmp_path / "nope.txt"], tmp_path, cache_dir=tmp_path)
    (tmp_path / "a.txt").write_text("hello\n")
    with pytest.raises(DataError, match="tokenizer"):
        tokenize_files([tmp_path / "a.txt"], tmp_path / "no-tokenizer", cache_dir=tmp_path)
    with pytest.raises(ValueError):
        tokenize_files([], tmp_path)


# ---------------------------------------------------------------- make_blocks


def test_make_blocks_shapes_and_remainder() -> None:
    ids = torch.arange(103, dtype=torch.int32)
    blocks = make_blocks(ids, 10)
    assert blocks.shape == (10, 10) and blocks.dtype == torch.int64
    assert blocks[3].tolist() == list(range(30, 40))
    assert make_blocks(ids, 103).shape == (1, 103)


def test_make_blocks_too_short() -> None:
    with pytest.raises(DataError, match="fewer than one block"):
        make_blocks(torch.arange(5), 6)
    with pytest.raises(ValueError):
        make_blocks(torch.arange(6).reshape(2, 3), 2)


# ---------------------------------------------------------------- models


def test_model_config_from_mapping_vocab_default_and_override() -> None:
    config = model_config_from_mapping({"n_layer": 3, "n_embd": 48, "n_head": 4}, 1234)
    assert config.model_type == "gpt2"
    assert (config.n_layer, config.n_embd, config.vocab_size) == (3, 48, 1234)
    config = model_config_from_mapping({"model_type": "gpt2", "vocab_size": 99}, 1234)
    assert config.vocab_size == 99
    assert model_config_from_mapping({}, None).vocab_size == GPT2Config().vocab_size


def test_model_config_from_mapping_unknown_type() -> None:
    with pytest.raises(ConfigError, match="model_type"):
        model_config_from_mapping({"model_type": "not-a-model"}, 100)


def test_build_model_is_seeded_by_caller() -> None:
    torch.manual_seed(3)
    first = build_model(tiny_config())
    torch.manual_seed(3)
    second = build_model(tiny_config())
    assert first.training
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    torch.manual_seed(4)
    third = build_model(tiny_config())
    assert not torch.equal(
        third.state_dict()["lm_head.weight"], first.state_dict()["lm_head.weight"]
    )


def test_build_model_dtype_casts_the_seeded_float32_init() -> None:
    torch.manual_seed(0)
    fp32 = build_model(tiny_config())
    torch.manual_seed(0)
    bf16 = build_model(tiny_config(), dtype="bfloat16")
    weight = "transformer.h.0.attn.c_attn.weight"
    assert bf16.state_dict()[weight].dtype == torch.bfloat16
    assert torch.equal(bf16.state_dict()[weight], fp32.state_dict()[weight].bfloat16())
    with pytest.raises(ValueError, match="dtype"):
        build_model(tiny_config(), dtype="int8")


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 8)
        self.head = nn.Linear(8, vocab_size)

    def forward(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids_BT))


def test_placeholder_init_keeps_the_seeded_build_but_for_random_values() -> None:
    config = tiny_config(n_layer=1)
    adapter = LoraSpec(r=4, alpha=8, target_modules=("c_attn",))
    torch.manual_seed(0)
    seeded = dict(build_model(config, "bfloat16", adapter).named_parameters())
    host_rng = torch.get_rng_state()
    with placeholder_init():
        placeholder = dict(build_model(config, "bfloat16", adapter).named_parameters())
        again = dict(build_model(config, "bfloat16", adapter).named_parameters())
    assert torch.equal(torch.get_rng_state(), host_rng)  # nothing drawn
    assert placeholder.keys() == seeded.keys()
    for name, p in placeholder.items():
        q = seeded[name]
        assert (p.shape, p.dtype, p.requires_grad) == (q.shape, q.dtype, q.requires_grad), name
        assert torch.equal(p, again[name]), name  # deterministic
        if torch.all(q == q.flatten()[0]):  # a constant init (norm weights, biases, LoRA B)
            assert torch.equal(p, q), name
        else:  # same spread (the seeded values are random: 20% for the smallest tensors)
            spread = q.float().std().item()
            assert p.float().std().item() == pytest.approx(spread, rel=0.2), name
            assert abs(p.float().mean().item()) < 0.1 * spread, name


def test_placeholder_init_leaves_builds_in_other_threads_seeded() -> None:
    import threading

    config = tiny_config(n_layer=1)
    torch.manual_seed(3)
    expected = build_model(config).state_dict()
    built: dict[str, torch.Tensor] = {}

    def build_seeded() -> None:
        torch.manual_seed(3)
        built.update(build_model(config).state_dict())

    with placeholder_init():
        other = threading.Thread(target=build_seeded)
        other.start()
        other.join()
    assert built.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(built[name], tensor), name


def test_build_model_factory_and_bad_factory() -> None:
    assert isinstance(build_model(TinyLM), TinyLM)
    with pytest.raises(TypeError, match="nn.Module"):
        build_model(lambda: "not a module")  # type: ignore[arg-type,return-value]


def test_build_model_from_saved_directory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model(tiny_config())
    path = save_weights(model, tmp_path / "ckpt")
    assert path == tmp_path / "ckpt"
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    loaded = build_model(path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(DataError):
        build_model(str(tmp_path / "missing-model"))


def test_save_weights_replaces_existing_directory_and_plain_module(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    model = TinyLM()
    assert save_weights(model, target) == target
    assert sorted(os.listdir(target)) == ["model.pt"]
    state = torch.load(target / "model.pt", weights_only=True)
    assert torch.equal(state["head.weight"], model.head.weight)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temp directories left


def test_lm_logits_and_causal_lm_loss() -> None:
    torch.manual_seed(0)
    model = build_model(tiny_config()).eval()
    input_ids_BT = torch.randint(0, 101, (3, 9))
    logits_BTV = lm_logits(model, input_ids_BT)
    assert logits_BTV.shape == (3, 9, 101)
    shifted = nn.functional.cross_entropy(
        logits_BTV[:, :-1].reshape(-1, 101), input_ids_BT[:, 1:].reshape(-1)
    )
    loss = causal_lm_loss(logits_BTV, input_ids_BT)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, shifted, rtol=1e-6, atol=0)
    # Bit for bit the loss transformers computes itself from labels.
    with torch.no_grad():
        assert torch.equal(loss, model(input_ids_BT, labels=input_ids_BT).loss)
    assert causal_lm_loss(logits_BTV.bfloat16(), input_ids_BT).dtype == torch.float32
    assert lm_logits(TinyLM(), torch.zeros(2, 4, dtype=torch.long)).shape == (2, 4, 11)


def test_hf_model_class_from_config() -> None:
    torch.manual_seed(0)
    assert type(build_model(tiny_config())) is type(
        AutoModelForCausalLM.from_config(tiny_config())
    )


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_token_cache_files_follow_the_umask(text_files, tmp_path: Path, mask: int,
                                            mode: int) -> None:
    previous = os.umask(mask)
    try:
        tokenize_files(text_files, TOKENIZER_DIR, cache_dir=tmp_path / "cache")
    finally:
        os.umask(previous)
    (cache_file,) = (tmp_path / "cache").iterdir()
    assert cache_file.stat().st_mode & 0o777 == mode
