"""Text datasets: WikiText-style split files -> token ids -> fixed-length blocks.

The pipeline is ``find_splits`` -> ``tokenize_files`` (cached on disk) -> ``make_blocks``.
Tokenization is done in chunks of whole lines, batched through the tokenizer, so that a
``max_tokens`` prefix of a 9 MB file costs only the lines it needs. For the GPT-2 byte-level BPE
tokenizer the chunked ids equal those of tokenizing each file as one string (lines of WikiText end
in a newline and the next line starts with a space, so no pre-token spans a chunk boundary).

Shapes: ``ids_L`` is a 1-D tensor of L token ids; ``blocks_NT`` holds N blocks of T ids.

Example:
    >>> from pathlib import Path
    >>> data = Path("../shared/data")
    >>> splits = find_splits(data / "wikitext-2")
    >>> ids_L = tokenize_files([splits["valid"]], data / "gpt2-tokenizer", max_tokens=4096)
    >>> make_blocks(ids_L, 128).shape
    torch.Size([32, 128])
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import itertools
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweepmaster.errors import DataError

if TYPE_CHECKING:
    import torch

__all__ = ["cached_tokenizer", "check_utf8", "count_tokens", "find_splits", "load_tokenizer",
           "make_blocks", "tokenize_files"]

#: Lines per chunk handed to the tokenizer, and chunks per batched tokenizer call.
_LINES_PER_CHUNK = 256
_CHUNKS_PER_CALL = 16
#: Bytes read at a time when checking that a file is UTF-8.
_UTF8_PIECE_BYTES = 1 << 20
#: Bumped whenever the cache file format or the tokenization procedure changes.
_CACHE_VERSION = 1


def find_splits(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Find the WikiText-2 split files in a directory.

    For each split, ``wiki.<split>.tokens`` is preferred, else ``wiki.<split>.raw``.

    Args:
        directory: A directory holding ``wiki.{train,valid,test}.{tokens,raw}``.

    Returns:
        ``{"train": path, "valid": path}`` plus ``"test"`` when that file exists.

    Raises:
        DataError: The train or valid split is missing (the message names the directory and the
            file names looked for).
    """
    root = Path(directory)
    splits: dict[str, Path] = {}
    for split in ("train", "valid", "test"):
        for suffix in ("tokens", "raw"):
            path = root / f"wiki.{split}.{suffix}"
            if path.is_file():
                splits[split] = path
                break
    missing = [split for split in ("train", "valid") if split not in splits]
    if missing:
        expected = ", ".join(f"wiki.{s}.tokens or wiki.{s}.raw" for s in missing)
        raise DataError(f"{root}: missing {' and '.join(missing)} split; expected {expected}")
    return splits


def load_tokenizer(tokenizer_dir: str | os.PathLike[str]) -> Any:
    """Load a HuggingFace tokenizer from a local directory, offline.

    Args:
        tokenizer_dir: A directory written by ``save_pretrained`` (or holding ``vocab.json`` and
            ``merges.txt`` plus ``tokenizer_config.json`` for GPT-2).

    Returns:
        The tokenizer from ``AutoTokenizer.from_pretrained(..., local_files_only=True)`` (the fast,
        Rust-backed one when available).

    Raises:
        DataError: The directory does not exist or does not hold a loadable tokenizer.
    """
    from transformers import AutoTokenizer

    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise DataError(f"{path}: tokenizer directory not found")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path}: cannot load a tokenizer: {err}") from err


def cached_tokenizer(tokenizer_dir: str | os.PathLike[str]) -> Any:
    """:func:`load_tokenizer`, loaded once per state of the directory (for the checks).

    The cache key is the directory's absolute path and the names, sizes and modification
    times of its files, so an edited tokenizer is loaded again.

    Raises:
        DataError: As :func:`load_tokenizer`.
    """
    path = Path(tokenizer_dir).absolute()
    return _cached_tokenizer(str(path), directory_stamp(path))


@functools.lru_cache(maxsize=16)
def _cached_tokenizer(directory: str, stamp: tuple[tuple[str, int, int], ...]) -> Any:
    return load_tokenizer(directory)


def directory_stamp(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """Names, sizes and modification times (ns) of a directory's files: a cache key."""
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return ()
    stamp = []
    for entry in entries:
        try:
            stat = entry.stat()
        except OSError:
            continue
        stamp.append((entry.name, stat.st_size, stat.st_mtime_ns))
    return tuple(stamp)


def tokenize_files(
    paths: Sequence[str | os.PathLike[str]],
    tokenizer_dir: str | os.PathLike[str],
    max_tokens: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    on_tokenize: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Tokenize text files into one sequence of ids, with an on-disk cache.

    The files are concatenated with the tokenizer's EOS token between them (not after the last).
    With ``max_tokens``, tokenization stops as soon as enough ids exist, so the result is the
    exact prefix of the untruncated one. Results are cached in ``cache_dir`` under a key hashing
    each file's absolute path, size and mtime (ns), the contents of the tokenizer files and
    ``max_tokens``; cache files are written atomically and a corrupt one is re-made.

    Args:
        paths: Text files, in order.
        tokenizer_dir: Local tokenizer directory, see :func:`load_tokenizer`.
        max_tokens: Keep exactly this many ids (fewer only if the files hold fewer); ``None``
            keeps all.
        cache_dir: Where cache files live; default ``$XDG_CACHE_HOME/sweepmaster/tokens``, or
            ``~/.cache/sweepmaster/tokens``.
        on_tokenize: Called before tokenizing, that is only when the cache has no result.

    Returns:
        ``ids_L``: int32 token ids, 1-D.

    Raises:
        DataError: A file or the tokenizer is missing or unusable, or there are several files and
            the tokenizer has no EOS token.
        ValueError: ``paths`` is empty or ``max_tokens < 1``.
    """
    if not paths:
        raise ValueError("tokenize_files needs at least one file")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
    files = [Path(p).resolve() for p in paths]
    for path in files:
        if not path.is_file():
            raise DataError(f"{path}: text file not found")
    tok_dir = Path(tokenizer_dir)
    if not tok_dir.is_dir():
        raise DataError(f"{tok_dir}: tokenizer directory not found")

    cache_file = _cache_root(cache_dir) / f"{_cache_key(files, tok_dir, max_tokens)}.pt"
    cached = _read_cache(cache_file)
    if cached is not None:
        return cached
    if on_tokenize is not None:
        on_tokenize()
    ids_L = _tokenize_uncached(files, load_tokenizer(tok_dir), max_tokens)
    try:
        _write_cache(cache_file, ids_L)
    except (OSError, RuntimeError) as err:  # torch.save on a full disk: "unexpected pos"
        warnings.warn(f"{cache_file}: cannot write token cache: {err}", stacklevel=2)
    return ids_L


def check_utf8(path: str | os.PathLike[str]) -> None:
    """Check that a whole text file decodes as UTF-8 (read in 1 MiB pieces).

    Raises:
        DataError: The file cannot be read, or is not UTF-8 (the message gives the byte offset).
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with open(path, "rb") as handle:
            while piece := handle.read(_UTF8_PIECE_BYTES):
                try:
                    decoder.decode(piece)
                except UnicodeDecodeError as err:
                    raise DataError(f"{path}: not UTF-8: byte {piece[err.start]:#04x} at offset "
                                    f"{offset + err.start}") from None
                offset += len(piece)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8: it ends inside a character") from None
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err.strerror or err}") from err


def count_tokens(paths: Sequence[str | os.PathLike[str]], tokenizer: Any, at_most: int) -> int:
    """Count the ids :func:`tokenize_files` would give, tokenizing no more than needed.

    The text is chunked as :func:`tokenize_files` chunks it (whole lines, EOS between files),
    one chunk at a time, so counting stops soon after ``at_most`` ids.

    Args:
        paths: Text files, in order.
        tokenizer: A loaded tokenizer (:func:`load_tokenizer`).
        at_most: Stop counting once this many ids are found.

    Returns:
        ``min(number of ids, at_most)``.

    Raises:
        DataError: A file cannot be read as UTF-8 text, or several files and no EOS token.
    """
    if len(paths) > 1 and tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token to separate files with")
    num_ids = 0
    for index, path in enumerate(paths):
        num_ids += 1 if index > 0 else 0
        for batch in _chunk_batches(Path(path)):
            for chunk in batch:
                if num_ids >= at_most:
                    return at_most
                ids = tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]
                num_ids += len(ids)
    return min(num_ids, at_most)


def make_blocks(ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cut a 1-D id sequence into consecutive fixed-length blocks, dropping the remainder.

    Args:
        ids: ``ids_L``, 1-D integer token ids.
        block_size: T, ids per block.

    Returns:
        ``blocks_NT``: int64 ``(N, T)`` with ``N = L // T``.

    Raises:
        ValueError: ``ids`` is not 1-D or ``block_size < 1``.
        DataError: Fewer than ``block_size`` ids (not even one block).
    """
    import torch

    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_blocks = ids.numel() // block_size
    if num_blocks < 1:
        raise DataError(f"{ids.numel()} tokens are fewer than one block of {block_size}")
    return ids[: num_blocks * block_size].to(torch.int64).reshape(num_blocks, block_size)


def _tokenize_uncached(
    files: Sequence[Path], tokenizer: Any, max_tokens: int | None
) -> torch.Tensor:
    """Tokenize ``files`` (EOS between them), stopping early once ``max_tokens`` ids exist."""
    import torch

    eos_id = tokenizer.eos_token_id
    if len(files) > 1 and eos_id is None:
        raise DataError("the tokenizer has no EOS token to separate files with")
    pieces: list[torch.Tensor] = []
    num_ids = 0
    for index, path in enumerate(files):
        if index > 0:
            pieces.append(torch.tensor([eos_id], dtype=torch.int32))
            num_ids += 1
        for batch in _chunk_batches(path):
            if max_tokens is not None and num_ids >= max_tokens:
                break
            encoded = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
            for chunk_ids in encoded:
                pieces.append(torch.tensor(chunk_ids, dtype=torch.int32))
                num_ids += len(chunk_ids)
        if max_tokens is not None and num_ids >= max_tokens:
            break
    ids_L = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)
    return ids_L[:max_tokens].clone() if max_tokens is not None else ids_L


def _chunk_batches(path: Path) -> Iterator[list[str]]:
    """Yield lists of text chunks of ``_LINES_PER_CHUNK`` whole lines, read lazily."""
    try:
        with path.open(encoding="utf-8", newline="") as handle:
            while True:
                batch = []
                for _ in range(_CHUNKS_PER_CALL):
                    chunk = "".join(itertools.islice(handle, _LINES_PER_CHUNK))
                    if not chunk:
                        break
                    batch.append(chunk)
                if not batch:
                    return
                yield batch
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read text: {err}") from err


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sweepmaster" / "tokens"


def _cache_key(files: Sequence[Path], tokenizer_dir: Path, max_tokens: int | None) -> str:
    header = f"v{_CACHE_VERSION};chunk={_LINES_PER_CHUNK};max_tokens={max_tokens}"
    digest = hashlib.sha256(header.encode())
    for path in files:
        stat = path.stat()
        digest.update(f";{path};{stat.st_size};{stat.st_mtime_ns}".encode())
    for tok_file in sorted(p for p in tokenizer_dir.iterdir() if p.is_file()):
        digest.update(f";{tok_file.name};".encode())
        digest.update(hashlib.sha256(tok_file.read_bytes()).digest())
    return digest.hexdigest()[:32]


def _read_cache(cache_file: Path) -> torch.Tensor | None:
    """Return the cached ids, or ``None`` if the file is absent or corrupt."""
    import torch

    if not cache_file.is_file():
        return None
    try:
        ids_L = torch.load(cache_file, map_location="cpu", weights_only=True)
    except Exception:  # any unreadable cache file is simply re-made
        return None
    if not isinstance(ids_L, torch.Tensor) or ids_L.dtype != torch.int32 or ids_L.dim() != 1:
        return None
    return ids_L


def _write_cache(cache_file: Path, ids_L: torch.Tensor) -> None:
    """Write ``ids_L`` to ``cache_file`` atomically (temp file in the same directory + replace).

    The file gets the mode the umask gives (``mkstemp`` makes it owner-only), so a cache shared
    by a team is read by all of it.
    """
    import torch

    from sweepmaster.workload.causal_lm import _umask

    cache_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=cache_file.parent, prefix=".tmp-", suffix=".pt")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            torch.save(ids_L, handle)
        os.replace(tmp_name, cache_file)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
