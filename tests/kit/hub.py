"""A HuggingFace hub cache laid out as ``snapshot_download`` leaves it, for offline tests.

``<hf_home>/hub/models--<org>--<name>/refs/main`` holds the commit sha, and
``snapshots/<sha>/`` the files: a tiny GPT-2 (``save_pretrained``: config.json,
model.safetensors; and a ``pytorch_model.bin`` beside it, as the hub's gpt2 has) and the GPT-2
tokenizer's files. Tests point ``HF_HOME`` at it and set ``HF_HUB_OFFLINE=1``;
:class:`HubServer` serves such a cache over HTTP as the hub would.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tests.kit.data import TOKENIZER_DIR

#: The repository id tests name, and the two commits its cache holds (``main`` is the first).
REPO_ID = "smtest/tiny-gpt2"
MAIN_SHA = "1" * 40
OTHER_SHA = "2" * 40

#: Tiny GPT-2 shapes: two layers of width 32, the GPT-2 vocabulary.
TINY_GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64}


def make_hub_cache(hf_home: Path, repo_id: str = REPO_ID, *, seeds: tuple[int, ...] = (0, 1),
                   ) -> dict[str, Path]:
    """Write ``repo_id`` into ``hf_home/hub`` with one snapshot per seed; return sha -> folder.

    The first snapshot (``MAIN_SHA``) is what ``refs/main`` points at; the second
    (``OTHER_SHA``) holds other weights of the same shapes, reachable only by its sha.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(MAIN_SHA)
    folders = {}
    for sha, seed in zip((MAIN_SHA, OTHER_SHA), seeds, strict=False):
        folder = repo / "snapshots" / sha
        torch.manual_seed(seed)
        GPT2LMHeadModel(GPT2Config(**TINY_GPT2)).save_pretrained(folder)
        for file in TOKENIZER_DIR.iterdir():
            if file.is_file():
                shutil.copy(file, folder / file.name)
        torch.save(GPT2LMHeadModel(GPT2Config(**TINY_GPT2)).state_dict(),
                   folder / "pytorch_model.bin")  # the other weight format, as gpt2 has both
        folders[sha] = folder
    return folders


class HubServer:
    """A local stand-in of the hub's HTTP API, serving the repositories of ``hf_home``'s cache.

    Enough for ``huggingface_hub``'s ``model_info`` and ``snapshot_download``: model info and
    file trees of ``refs/main`` or a commit, and each file's metadata (``HEAD``) and bytes
    (``GET`` of ``/<repo>/resolve/<sha>/<file>``). A repository named ``.../gated`` answers
    every request 403 ``GatedRepo``; an unknown one 404 ``RepoNotFound``; an unknown revision
    404 ``RevisionNotFound``. ``requests`` records every path asked for.
    """

    def __init__(self, hf_home: Path) -> None:
        import http.server
        import threading

        self.hub = hf_home / "hub"
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:  # noqa: N802 (http.server's names)
                server.answer(self, body=False)

            def do_GET(self) -> None:  # noqa: N802
                server.answer(self, body=True)

            def log_message(self, *args: object) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()

    def answer(self, handler: Any, body: bool) -> None:
        import hashlib
        import json
        import re
        from urllib.parse import unquote, urlsplit

        path = unquote(urlsplit(handler.path).path)
        self.requests.append(f"{handler.command} {path}")
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?/?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo_id = (api or resolve)[1] if (api or resolve) else ""
        repo = self.hub / ("models--" + repo_id.replace("/", "--"))
        revision = (api[3] if api and api[3] else "main") if api else (resolve[2] if resolve
                                                                       else "")
        sha = ((repo / "refs" / revision).read_text() if (repo / "refs" / revision).is_file()
               else revision)
        folder = repo / "snapshots" / sha
        if repo_id.endswith("/gated"):
            return self.send(handler, 403, {"X-Error-Code": "GatedRepo"}, b"", body)
        if not repo.is_dir():
            return self.send(handler, 404, {"X-Error-Code": "RepoNotFound"}, b"", body)
        if not folder.is_dir():
            return self.send(handler, 404, {"X-Error-Code": "RevisionNotFound"}, b"", body)
        files = sorted(p.name for p in folder.iterdir() if p.is_file())
        if api and api[2] == "tree":
            tree = [{"type": "file", "path": name, "size": (folder / name).stat().st_size,
                     "oid": hashlib.sha1((folder / name).read_bytes()).hexdigest()}
                    for name in files]
            return self.send(handler, 200, {}, json.dumps(tree).encode(), body)
        if api:
            info = {"id": repo_id, "sha": sha, "siblings": [{"rfilename": n} for n in files]}
            return self.send(handler, 200, {}, json.dumps(info).encode(), body)
        if resolve and (folder / resolve[3]).is_file():
            data = (folder / resolve[3]).read_bytes()
            etag = hashlib.sha256(data).hexdigest()
            return self.send(handler, 200, {"X-Repo-Commit": sha, "ETag": f'"{etag}"'}, data,
                             body)
        return self.send(handler, 404, {"X-Error-Code": "EntryNotFound"}, b"", body)

    @staticmethod
    def send(handler: Any, code: int, headers: dict[str, str], data: bytes, body: bool) -> None:
        handler.send_response(code)
        for name, value in {**headers, "Content-Length": str(len(data))}.items():
            handler.send_header(name, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)
