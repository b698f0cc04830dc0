"""Data through HuggingFace ``datasets``: text, prompt/completion and chat, with loss masks.

The sweep's ``data.dataset`` names a ``datasets`` builder over local files (``json``, ``csv``,
``parquet``, ``text``, ``arrow`` with ``data.data_files``), a folder written by
``save_to_disk``, or a hub dataset id (``config_name`` picks its configuration). Rows follow
TRL's dataset formats (https://huggingface.co/docs/trl/dataset_formats):

* language modeling, ``text_field``: every token is a target;
* prompt-completion, ``prompt_field`` + ``completion_field``: only the completion's tokens are
  targets (TRL's ``completion_only_loss``);
* conversational, ``messages_field`` (a list of ``{"role", "content"}``): rendered with the
  tokenizer's chat template; only assistant turns are targets (TRL's ``assistant_only_loss``:
  each assistant message's content and end-of-turn tokens, not its role header).

Without a field named, the format is found as TRL finds it: a ``messages`` column, else
``prompt`` and ``completion``, else ``text``. Each example ends with the tokenizer's EOS token
(the text and completion formats; a chat template ends its turns itself).

Tokenizing is ``Dataset.map`` into an Arrow file of the ``datasets`` cache whose name is a
fingerprint of the source split (``Dataset._fingerprint``: its files and revision), the
tokenizer (its vocabulary, merges, special tokens and chat template) and every setting that
changes the tokens, so a relaunch or a second worker reads the file instead of tokenizing.

Blocks: with ``packing``, the examples' tokens are concatenated and cut into blocks of
``block_size`` (TRL's packing; the remainder is dropped); without it, each example is one row,
truncated to ``block_size`` and right-padded with the pad token (EOS when there is none) that
does not count. Right padding under a causal mask changes no counted target's logits, so no
attention mask is carried: a counted token attends only to the tokens before it, none of them
padding. Blocks without any target are dropped (a prompt longer than the block).

Shapes: ``(N, T)`` int64 ids and bool loss masks (see :mod:`sweepmaster.workload.spec`).

Example:
    >>> blocks = prepare_dataset(data, source="sweep.yaml")  # doctest: +SKIP
    >>> blocks.train.shape, blocks.train_mask.shape  # doctest: +SKIP
    (torch.Size([200, 64]), torch.Size([200, 64]))
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from sweepmaster.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

__all__ = ["BUILDERS", "DataSettings", "MaskedBlocks", "detect_format", "prepare_dataset"]

#: ``datasets``' packaged builders over local files that ``data.dataset`` may name.
BUILDERS = ("json", "csv", "parquet", "text", "arrow")
#: What ``data.dataset`` takes, as its refusals say.
_DATASET = (f"a datasets builder ({', '.join(BUILDERS)}) with data.data_files, a save_to_disk "
            "folder or a hub dataset id")
#: The builder of a data file by its suffix: a ``data.dataset`` ending so is a path, not an id.
_SUFFIX_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet",
                    ".txt": "text", ".arrow": "arrow"}
#: Bumped whenever the tokenization below changes: old cache files are not read.
_CACHE_VERSION = 1

Format = Literal["text", "prompt-completion", "messages"]


class DataSettings(Protocol):
    """The sweep's ``data`` section as this module reads it (``config.DataConfig``)."""

    dataset: str | None
    config_name: str | None
    data_files: dict[str, str | list[str]] | None
    train_split: str
    eval_split: str | None
    eval_fraction: float | None
    text_field: str | None
    prompt_field: str | None
    completion_field: str | None
    messages_field: str | None
    packing: bool
    block_size: int
    max_train_tokens: int | None
    max_eval_tokens: int | None
    cache_dir: Path | None


@dataclass(frozen=True)
class MaskedBlocks:
    """Train and evaluation blocks with their loss masks.

    Attributes:
        train: int64 ``(N, T)`` token ids.
        train_mask: bool ``(N, T)``: which tokens are targets.
        valid: int64 ``(M, T)``, or ``None`` without an evaluation split.
        valid_mask: bool ``(M, T)``, or ``None``.
    """

    train: torch.Tensor
    train_mask: torch.Tensor
    valid: torch.Tensor | None
    valid_mask: torch.Tensor | None


def prepare_dataset(data: DataSettings, tokenizer: Any, source: str,
                    on_tokenize: Callable[[], None] | None = None) -> MaskedBlocks:
    """Load, tokenize (or read from the cache), mask and block the sweep's dataset.

    Args:
        data: The ``data`` section (paths absolute).
        tokenizer: The loaded tokenizer (a fast one: chat masks use its offsets).
        source: The sweep file, for messages.
        on_tokenize: Called before a split the cache does not hold is tokenized.

    Returns:
        The blocks and masks.

    Raises:
        ConfigError: One line naming the key: an unknown builder or dataset, a missing data
            file or split, an empty split, a field the rows do not have, a chat dataset and a
            tokenizer without a chat template, or a split with no block holding a target.
    """
    with _quiet():
        return _prepare(data, tokenizer, source, on_tokenize)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No ``datasets`` progress bars: a refusal is one line, a launch says it tokenizes."""
    import datasets

    shown = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


def _prepare(data: DataSettings, tokenizer: Any, source: str,
             on_tokenize: Callable[[], None] | None) -> MaskedBlocks:
    """:func:`prepare_dataset`, quietly."""
    train, valid = load_splits(data, source)
    fmt, fields = detect_format(data, train.column_names, source)
    if fmt == "messages" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(source, "data.messages_field", "a tokenizer with a chat template "
                          f"for chat data, got {getattr(tokenizer, 'name_or_path', tokenizer)} "
                          "without one (tokenizer_config.json has no chat_template)")
    if valid is not None:
        missing = [field for field in fields if field not in valid.column_names]
        if missing:
            raise ConfigError(source, _field_key(data, fmt, missing[0]),
                              f"a field of the evaluation rows too, got columns "
                              f"{valid.column_names}")
    blocks: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    for name, split, limit in (("train", train, data.max_train_tokens),
                               ("eval", valid, data.max_eval_tokens)):
        if split is None:
            blocks.append((None, None))
            continue
        try:
            ids, offsets, mask = _tokenized(split, fmt, fields, tokenizer, data, on_tokenize)
        except DataError as err:  # a row of another shape than its format's
            raise ConfigError(source, _field_key(data, fmt, fields[0]), f"rows of the "
                              f"{fmt} format in the {name} split: {err}") from None
        ids_NT, mask_NT = _blocks(ids, offsets, mask, data.block_size, data.packing,
                                  _pad_id(tokenizer), limit)
        if ids_NT.shape[0] == 0:
            key = "data.train_split" if name == "train" else (
                "data.eval_split" if data.eval_split is not None else "data.eval_fraction")
            raise ConfigError(source, key, f"a split with at least one block of "
                              f"{data.block_size} tokens (data.block_size) holding a target, "
                              f"got none in its {len(split)} rows")
        blocks.append((ids_NT, mask_NT))
    (train_ids, train_mask), (valid_ids, valid_mask) = blocks
    assert train_ids is not None and train_mask is not None
    return MaskedBlocks(train_ids, train_mask, valid_ids, valid_mask)


def load_splits(data: DataSettings, source: str) -> tuple[Any, Any]:
    """The train split and the evaluation split (``None`` without one) as ``Dataset`` s.

    Raises:
        ConfigError: See :func:`prepare_dataset`.
    """
    import datasets

    name = data.dataset
    assert name is not None
    data_files = None if data.data_files is None else {
        split: [files] if isinstance(files, str) else list(files)
        for split, files in data.data_files.items()}
    for split_name, files in (data_files or {}).items():
        for file in files:
            if not any(ch in file for ch in "*?[") and not Path(file).is_file():
                raise ConfigError(source, "data.data_files", f"existing files, no such file: "
                                  f"{file}")
        if all(_blank(Path(file)) for file in files):
            raise _empty_split(data, split_name, source)
    try:
        if name in BUILDERS:
            if not data_files:
                raise ConfigError(source, "data.data_files", f"the files of the {name} "
                                  "builder, e.g. {train: train.jsonl}, got none")
            loaded = datasets.load_dataset(name, data_files=data_files, cache_dir=_cache(data))
        elif Path(name).is_dir() and _saved_to_disk(Path(name)):
            loaded = datasets.load_from_disk(name)
        elif Path(name).is_file():
            builder = _SUFFIX_BUILDERS.get(Path(name).suffix, "json")
            raise ConfigError(source, "data.dataset", f"{_DATASET}, got the data file {name} "
                              f"(write dataset: {builder}, data_files: {{train: {name}}})")
        elif Path(name).is_absolute() or Path(name).suffix in _SUFFIX_BUILDERS:
            raise ConfigError(source, "data.dataset", f"{_DATASET}, got {name!r}: no such file "
                              "or folder (relative to the sweep file)")
        else:
            loaded = datasets.load_dataset(name, data.config_name, data_files=data_files,
                                           cache_dir=_cache(data))
    except ConfigError:
        raise
    except Exception as err:  # datasets raises many kinds: not found, offline, bad files
        empty = re.search(r'Instruction "([^"]+)" corresponds to no data', str(err))
        if empty is not None:  # a split whose files hold no row (a CSV header only, say)
            raise _empty_split(data, empty.group(1), source) from None
        raise ConfigError(source, "data.dataset", f"{_DATASET} that can be loaded, got "
                          f"{name!r}: {_first_line(err)}") from None
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    train = _split(loaded, data.train_split, "data.train_split", source)
    valid = None
    if data.eval_split is not None:
        valid = _split(loaded, data.eval_split, "data.eval_split", source)
    elif data.eval_fraction is not None:
        held = train.train_test_split(test_size=data.eval_fraction, seed=0, shuffle=True)
        train, valid = held["train"], held["test"]
        if len(valid) == 0 or len(train) == 0:
            raise ConfigError(source, "data.eval_fraction", "a fraction leaving rows in both "
                              f"parts of the {len(train) + len(valid)} training rows, got "
                              f"{data.eval_fraction}")
    return train, valid


def detect_format(data: DataSettings, columns: Sequence[str],
                  source: str) -> tuple[Format, tuple[str, ...]]:
    """The rows' format and its fields: those named in ``data``, else TRL's column names.

    Raises:
        ConfigError: A named field is not a column, or no format's columns are there.
    """
    named: list[tuple[Format, tuple[str | None, ...]]] = [
        ("messages", (data.messages_field,)),
        ("prompt-completion", (data.prompt_field, data.completion_field)),
        ("text", (data.text_field,)),
    ]
    for fmt, fields in named:
        if any(field is not None for field in fields):
            for field in fields:
                if field is None or field not in columns:
                    key = _field_key(data, fmt, field)
                    raise ConfigError(source, key, f"a column of the rows, one of {list(columns)}"
                                      f", got {field!r}")
            return fmt, tuple(f for f in fields if f is not None)
    for fmt, fields in (("messages", ("messages",)), ("prompt-completion", ("prompt",
                        "completion")), ("text", ("text",))):
        if all(field in columns for field in fields):
            return fmt, fields  # type: ignore[return-value]
    raise ConfigError(source, "data.text_field", "a field to train on (text_field, prompt_field "
                      f"and completion_field, or messages_field), got rows with columns "
                      f"{list(columns)}")


# ---------------------------------------------------------------------- tokenizing


def _tokenized(split: Any, fmt: Format, fields: tuple[str, ...], tokenizer: Any,
               data: DataSettings, on_tokenize: Callable[[], None] | None,
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokenize a split through ``Dataset.map`` into the cache; flat ids, row offsets, mask."""
    key = _fingerprint(split, fmt, fields, tokenizer)
    cache_file = _cache_root(data) / f"tokens-{key}.arrow"
    if on_tokenize is not None and not cache_file.is_file():
        on_tokenize()
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    encode = _ENCODERS[fmt]
    eos = tokenizer.eos_token_id

    def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        rows = [encode(tokenizer, eos, *(batch[field][i] for field in fields))
                for i in range(len(batch[fields[0]]))]
        return {"input_ids": [ids for ids, _ in rows], "loss_mask": [mask for _, mask in rows]}

    mapped = split.map(tokenize, batched=True, remove_columns=split.column_names,
                       cache_file_name=str(cache_file), new_fingerprint=key,
                       load_from_cache_file=True, desc="tokenizing")
    table = mapped.with_format("arrow")[:]
    ids_column = table.column("input_ids").combine_chunks()
    mask_column = table.column("loss_mask").combine_chunks()
    offsets = np.asarray(ids_column.offsets, dtype=np.int64)
    ids = np.asarray(ids_column.values, dtype=np.int64)[offsets[0]:offsets[-1]]
    mask = np.asarray(mask_column.values, dtype=np.bool_)[offsets[0]:offsets[-1]]
    return ids, offsets - offsets[0], mask


def _encode_text(tokenizer: Any, eos: int | None, text: Any) -> tuple[list[int], list[bool]]:
    ids = _ids(tokenizer, _string(text)) + ([eos] if eos is not None else [])
    return ids, [True] * len(ids)


def _encode_completion(tokenizer: Any, eos: int | None, prompt: Any,
                       completion: Any) -> tuple[list[int], list[bool]]:
    prompt_ids = _ids(tokenizer, _string(prompt))
    completion_ids = _ids(tokenizer, _string(completion)) + ([eos] if eos is not None else [])
    return prompt_ids + completion_ids, [False] * len(prompt_ids) + [True] * len(completion_ids)


def _encode_chat(tokenizer: Any, eos: int | None,
                 messages: Any) -> tuple[list[int], list[bool]]:
    """The chat template's tokens; targets: each assistant turn after its role header."""
    del eos  # the template ends turns itself
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise DataError(f"a chat row must be a list of {{role, content}} messages, got "
                        f"{str(messages)[:80]}")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:index], tokenize=False,
                                                  add_generation_prompt=True)) if index else 0
        stop = len(tokenizer.apply_chat_template(messages[: index + 1], tokenize=False))
        spans.append((start, stop))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a < stop and b > start for start, stop in spans)
            for a, b in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


_ENCODERS: dict[str, Callable[..., tuple[list[int], list[bool]]]] = {
    "text": _encode_text, "prompt-completion": _encode_completion, "messages": _encode_chat}


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise DataError(f"a text field must hold strings, got {type(value).__name__} "
                        f"{str(value)[:80]!r}")
    return value


# ---------------------------------------------------------------------- blocks


def _blocks(ids: np.ndarray, offsets: np.ndarray, mask: np.ndarray, block_size: int,
            packing: bool, pad_id: int, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, T)`` ids and masks: packed, or one padded row per example; no targetless block."""
    import torch  # not for `validate` of other data

    if packing:
        if limit is not None:
            ids, mask = ids[:limit], mask[:limit]
        num_blocks = len(ids) // block_size
        ids_NT = ids[: num_blocks * block_size].reshape(num_blocks, block_size)
        mask_NT = mask[: num_blocks * block_size].reshape(num_blocks, block_size)
    else:
        num_rows = len(offsets) - 1
        if limit is not None:
            num_rows = min(num_rows, limit // block_size)
        ids_NT = np.full((num_rows, block_size), pad_id, dtype=np.int64)
        mask_NT = np.zeros((num_rows, block_size), dtype=np.bool_)
        for row in range(num_rows):
            start = offsets[row]
            stop = min(offsets[row + 1], start + block_size)
            ids_NT[row, : stop - start] = ids[start:stop]
            mask_NT[row, : stop - start] = mask[start:stop]
    keep = mask_NT[:, 1:].any(axis=1)
    return (torch.from_numpy(np.ascontiguousarray(ids_NT[keep])),
            torch.from_numpy(np.ascontiguousarray(mask_NT[keep])))


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    pad = tokenizer.eos_token_id if pad is None else pad
    return int(pad) if pad is not None else 0


# ---------------------------------------------------------------------- helpers


def _split(loaded: Any, name: str, key: str, source: str) -> Any:
    if name not in loaded:
        raise ConfigError(source, key, f"a split of the dataset, one of {list(loaded)}, got "
                          f"{name!r}")
    split = loaded[name]
    if len(split) == 0:
        raise ConfigError(source, key, f"a split with rows, got an empty {name!r} split")
    return split


def _empty_split(data: DataSettings, name: str, source: str) -> ConfigError:
    """The refusal of split ``name`` of ``data.data_files`` holding no row, naming its key."""
    key = {data.train_split: "data.train_split", data.eval_split: "data.eval_split"}.get(
        name, "data.data_files")
    return ConfigError(source, key, f"a split with rows, got an empty {name!r} split (its "
                       "data files hold no row)")


def _blank(path: Path) -> bool:
    """Whether a data file holds nothing but whitespace (read up to its first character)."""
    if not path.is_file():
        return False  # a glob pattern: datasets resolves it
    with path.open("rb") as file:
        while chunk := file.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _field_key(data: DataSettings, fmt: Format, field: str | None) -> str:
    """The key naming ``field`` of format ``fmt`` (one the user left out: its own key)."""
    if fmt != "prompt-completion":
        return "data.messages_field" if fmt == "messages" else "data.text_field"
    if data.prompt_field is None or field in (data.prompt_field, "prompt"):
        return "data.prompt_field"
    return "data.completion_field"


def _saved_to_disk(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _cache(data: DataSettings) -> str | None:
    return None if data.cache_dir is None else str(data.cache_dir / "datasets")


def _cache_root(data: DataSettings) -> Path:
    if data.cache_dir is not None:
        return data.cache_dir / "datasets"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sweepmaster" / "datasets"


def _fingerprint(split: Any, fmt: Format, fields: tuple[str, ...], tokenizer: Any) -> str:
    """The tokenized split's cache key: source, tokenizer, format and fields, version."""
    described = {"version": _CACHE_VERSION, "source": split._fingerprint, "format": fmt,
                 "fields": fields, "tokenizer": tokenizer_key(tokenizer)}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


def tokenizer_key(tokenizer: Any) -> str:
    """A hash of what makes a tokenizer's ids: vocabulary and merges, special tokens, template."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    digest.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return digest.hexdigest()


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
