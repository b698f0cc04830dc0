"""Models and tokenizers named by a HuggingFace hub id, resolved to a local snapshot once.

``model.pretrained`` / ``data.tokenizer`` (and ``TrainSpec.model``) name a local directory saved
with ``save_pretrained`` or a hub id (``gpt2``, ``meta-llama/Llama-3.2-1B``). An id is resolved
as transformers resolves it, through huggingface_hub: the HuggingFace cache first
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), else a download
with huggingface_hub's own progress bars (``snapshot_download``), never when ``$HF_HUB_OFFLINE``
is set. What comes back is a :class:`Snapshot`: the local snapshot folder
(``hub/models--org--name/snapshots/<sha>/``) and its commit sha, which everything downstream
reads as a plain directory (``from_pretrained(..., local_files_only=True)``);
:func:`snapshot_revision` reads the sha back from such a path, so the architecture key follows it.

A branch or tag (``main``, the default) is resolved to its commit once per process: every trial
of a sweep trains the same revision even if the branch moves meanwhile.

Only what a causal LM and its tokenizer need is downloaded: config, tokenizer and chat-template
files and one weight format (safetensors when the repository has it, else PyTorch ``.bin``),
plus the repository's Python files when ``trust_remote_code`` is set.

Example:
    >>> snapshot = resolve("gpt2")  # doctest: +SKIP
    >>> snapshot.path.name == snapshot.revision  # doctest: +SKIP
    True
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sweepmaster.errors import DataError

__all__ = ["HubRevisionError", "Snapshot", "hub_cache_dir", "is_hub_id", "resolve",
           "snapshot_revision"]

#: Files a tokenizer or a model config may need (tokenizer.json, vocab.json, merges.txt,
#: sentencepiece models, chat templates).
_CONFIG_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")

#: Weight files of a causal LM, the preferred format first (as ``from_pretrained`` picks).
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


#: A snapshot folder of the hub cache: ``models--<org>--<name>/snapshots/<sha>``.
_SNAPSHOT_PATH = re.compile(r"(^|/)models--[^/]+/snapshots/([0-9a-f]{40})/?$")


class HubRevisionError(DataError):
    """The repository is there, the revision asked for is not (or not in the cache, offline)."""


@dataclass(frozen=True)
class Snapshot:
    """A model or tokenizer on local disk.

    Attributes:
        path: The directory to load from (absolute).
        revision: The commit sha of a hub snapshot; ``None`` for a directory given as is.
    """

    path: Path
    revision: str | None = None


def snapshot_revision(path: str | os.PathLike[str]) -> str | None:
    """The commit sha of a hub cache snapshot folder, or ``None`` for any other directory."""
    found = _SNAPSHOT_PATH.search(Path(path).as_posix())
    return found[2] if found else None


def is_hub_id(name: str | os.PathLike[str]) -> bool:
    """Whether ``name`` is no existing directory but a valid hub repository id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if isinstance(name, os.PathLike) and not isinstance(name, Path):
        return False
    text = str(name)
    if Path(text).expanduser().is_dir() or Path(text).is_absolute():
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def hub_cache_dir() -> Path:
    """The HuggingFace hub cache as the environment says now (``HF_HUB_CACHE``, ``HF_HOME``)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get(name, "").upper()
             for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(flag in constants.ENV_VARS_TRUE_VALUES
                                           for flag in flags)


def resolve(name: str | os.PathLike[str], revision: str | None = None, *,
            kind: Literal["model", "tokenizer"] = "model",
            trust_remote_code: bool = False) -> Snapshot:
    """The local directory of a model or tokenizer: ``name`` itself, or its hub snapshot.

    A directory is returned as it is (``revision`` is ignored; a snapshot folder of the cache
    keeps its sha). A hub id is looked up in the
    cache, or downloaded unless offline; the result is remembered for the process, keyed by
    everything above and the cache directory, so a sweep resolves each id once.

    Args:
        name: A directory, or a hub repository id (``org/name`` or ``name``).
        revision: A branch, tag or commit sha of the repository; ``None``: ``main``.
        kind: ``"model"`` also needs weight files; ``"tokenizer"`` only its files.
        trust_remote_code: Also fetch the repository's Python files (custom model code).

    Returns:
        The snapshot.

    Raises:
        DataError: ``name`` is neither a directory nor a hub id; the repository is unknown,
            private or gated and no token grants it; offline (``HF_HUB_OFFLINE``) and not in
            the cache; the hub cannot be reached and the cache does not hold it; a model
            snapshot has no weight files.
        HubRevisionError: The repository has no such revision (online), or, offline, the
            cache holds the repository but not that revision.
    """
    if Path(name).expanduser().is_dir():
        path = Path(name).expanduser().absolute()
        return Snapshot(path, snapshot_revision(path))
    if not is_hub_id(name):
        found = "not a directory" if os.path.lexists(Path(name).expanduser()) \
            else "no such directory"
        raise DataError(f"{name} ({found}, and not a HuggingFace hub id)")
    return _resolve_hub(str(name), revision, kind, trust_remote_code, str(hub_cache_dir()),
                        _offline())


@functools.lru_cache(maxsize=64)
def _resolve_hub(repo_id: str, revision: str | None, kind: str, trust_remote_code: bool,
                 cache_dir: str, offline: bool) -> Snapshot:
    """:func:`resolve` of a hub id (failures are not remembered: a retry asks again)."""
    from huggingface_hub import snapshot_download

    shown = repo_id if revision is None else f"{repo_id}@{revision}"
    try:
        if offline:  # complete in what a model needs: huggingface_hub checks the config
            # and tokenizer files against the cached file list, the weights are checked below
            patterns = [*_CONFIG_PATTERNS, *(["*.py"] if trust_remote_code else [])]
            folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                       local_files_only=True, allow_patterns=patterns)
        else:
            patterns = _remote_files(repo_id, revision, kind, trust_remote_code)
            # By the name asked for, so the cache records the branch (refs/<name>) for later
            # offline runs; the folder's name is the commit it resolved to.
            folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                       allow_patterns=patterns)
    except Exception as exc:
        raise _hub_error(exc, repo_id, revision, shown, Path(cache_dir), offline) from exc
    path = Path(folder)
    if kind == "model" and not any(path.glob(pattern) for pattern in _WEIGHT_PATTERNS):
        where = "the HuggingFace cache (HF_HUB_OFFLINE is set)" if offline else path
        raise DataError(f"{shown} (no weight files, *.safetensors or *.bin, in {where}: "
                        "download the model once online)")
    return Snapshot(path, path.name)


def _remote_files(repo_id: str, revision: str | None, kind: str,
                  trust_remote_code: bool) -> list[str]:
    """The file patterns to download from ``revision`` (its file list, from the hub)."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo_id, revision=revision)
    patterns = list(_CONFIG_PATTERNS)
    if kind == "model":
        names = [sibling.rfilename for sibling in info.siblings or []]
        patterns += next(([pattern] for pattern in _WEIGHT_PATTERNS
                          if any(Path(n).match(pattern) for n in names)), [])
    if trust_remote_code:
        patterns.append("*.py")
    return patterns


def _hub_error(exc: Exception, repo_id: str, revision: str | None, shown: str,
               cache_dir: Path, offline: bool) -> DataError:
    """One line for what huggingface_hub raised while resolving ``repo_id``."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, RevisionNotFoundError):
        return HubRevisionError(f"{shown} (no such revision on the HuggingFace hub)")
    if isinstance(exc, GatedRepoError):
        return DataError(f"{shown} (a gated model: accept its terms on huggingface.co and log "
                         "in with hf auth login, or set HF_TOKEN)")
    if isinstance(exc, RepositoryNotFoundError):
        return DataError(f"{shown} (no such model on the HuggingFace hub, or a private one: "
                         "log in with hf auth login, or set HF_TOKEN)")
    repo_folder = cache_dir / ("models--" + repo_id.replace("/", "--"))
    if isinstance(exc, LocalEntryNotFoundError) and revision is not None and repo_folder.is_dir():
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        return HubRevisionError(f"{shown} (the HuggingFace cache {cache_dir} holds {repo_id} but "
                                f"not this revision, and {why})")
    if isinstance(exc, LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        return DataError(f"{shown} (no such directory, and not in the HuggingFace cache "
                         f"{cache_dir}, and {why}: download it once online)")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return DataError(f"{shown} (cannot be fetched from the HuggingFace hub: {detail})")
