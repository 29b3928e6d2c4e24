"""A Hugging Face Hub on loopback serving one model repo, for download tests without a network.

It answers the HTTP API that `huggingface_hub.snapshot_download` itself calls (the real client library, not
a stand-in): repo info (`/api/models/<repo>/revision/<rev>`), the recursive tree listing
(`/api/models/<repo>/tree/<rev>`), and `HEAD` / `GET` of `/<repo>/resolve/<rev>/<path>` with the
X-Repo-Commit / ETag / X-Linked-Etag headers and byte ranges (206) for resumed downloads; a file can be\nmade to drop its connection halfway once (a network failure mid-download). Every request is
logged so a test can see what was fetched and how.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".png")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class LocalHub:
    """`files` {repo path: bytes} of `repo` at `commit` (branch "main"), served on 127.0.0.1:port."""

    def __init__(self, repo: str, files: dict[str, bytes], commit: str, drop_once: tuple[str, ...] = ()):
        """drop_once: files whose first full GET stops halfway (the connection closes, as a network drop)."""
        self.repo, self.files, self.commit = repo, dict(files), commit
        self.drop_once = set(drop_once)
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub.handle(self, head=True)

            def do_GET(self):
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> LocalHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched(self) -> set[str]:
        """Repo paths whose bytes were sent (GET of a file)."""
        prefix = f"/{self.repo}/resolve/"
        return {
            p.split("/", 1)[1]
            for m, p, _ in self.log
            if m == "GET" and p.startswith(prefix)
            for p in [p[len(prefix) :]]
        }

    # ---- the API ---------------------------------------------------------------------------------------
    def _revision_ok(self, rev: str) -> bool:
        return rev in ("main", self.commit)

    def handle(self, req: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(req.path).path)
        self.log.append(("HEAD" if head else "GET", path, req.headers.get("Range")))
        info = re.fullmatch(rf"/api/models/{re.escape(self.repo)}/revision/(.+)", path)
        tree = re.fullmatch(rf"/api/models/{re.escape(self.repo)}/tree/([^/]+)/?", path)
        resolve = re.fullmatch(rf"/{re.escape(self.repo)}/resolve/([^/]+)/(.+)", path)
        if info and self._revision_ok(info[1]):
            return self._json(
                req,
                {
                    "id": self.repo,
                    "modelId": self.repo,
                    "sha": self.commit,
                    "private": False,
                    "siblings": [{"rfilename": f} for f in sorted(self.files)],
                },
            )
        if tree and self._revision_ok(tree[1]):
            return self._json(req, [self._entry(f) for f in sorted(self.files)])
        if resolve and self._revision_ok(resolve[1]) and resolve[2] in self.files:
            return self._file(req, resolve[2], head)
        self._json(req, {"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})

    def _entry(self, name: str) -> dict:
        data = self.files[name]
        entry = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": name}
        if name.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _file(self, req: BaseHTTPRequestHandler, name: str, head: bool) -> None:
        data = self.files[name]
        lfs = name.endswith(LFS_SUFFIXES)
        etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
        start, status = 0, 200
        rng = re.fullmatch(r"bytes=(\d+)-", req.headers.get("Range") or "")
        if rng and not head:
            start, status = min(int(rng[1]), len(data)), 206
        req.send_response(status)
        req.send_header("X-Repo-Commit", self.commit)
        req.send_header("ETag", f'"{etag}"')
        if lfs:
            req.send_header("X-Linked-Etag", f'"{etag}"')
            req.send_header("X-Linked-Size", str(len(data)))
        if status == 206:
            req.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        req.send_header("Content-Length", str(len(data) - start))
        req.send_header("Accept-Ranges", "bytes")
        req.end_headers()
        if head:
            return
        if name in self.drop_once and start == 0:
            self.drop_once.discard(name)
            req.wfile.write(data[: len(data) // 2])
            req.wfile.flush()
            req.connection.shutdown(socket.SHUT_RDWR)  # the promised length never arrives
            req.close_connection = True
            return
        req.wfile.write(data[start:])

    @staticmethod
    def _json(req, body, status: int = 200, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        req.send_response(status)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            req.send_header(k, v)
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)


def repo_files(model_dir: str | os.PathLike, extra: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """A model directory's files plus `extra` ones (what a release repo also holds)."""
    out = {}
    for name in sorted(os.listdir(model_dir)):
        with open(os.path.join(model_dir, name), "rb") as f:
            out[name] = f.read()
    out.update(extra or {})
    return out
