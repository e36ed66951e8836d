"""A local HTTP server shaped like the Hugging Face Hub, for `kvchat models pull` tests: the
real `huggingface_hub` client talks to it through ``HF_ENDPOINT``.

It serves ``/{repo}/resolve/{revision}/{file}`` (HEAD and GET with ``Range``: resumable),
``/api/models/{repo}/paths-info/{revision}`` and ``/api/models/{repo}`` (the LFS sha256 and
size kvchat checks). It can send the first download slowly, so that a test can stop the
client mid-file, and it can publish a wrong sha256 or a size no disk has, publish no
sha256 at all, answer its API with an error, or redirect downloads to another server (a CDN
on another origin), noting the ``Authorization`` header every request carried.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COMMIT = "a" * 40
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<name>.+)$")


class HubServer:
    """Serves ``files`` ({(repo, file name): bytes}) until :meth:`close`."""

    def __init__(self, files: dict[tuple[str, str], bytes]) -> None:
        self.files = files
        self.wrong_sha256 = False
        self.claimed_size: int | None = None
        # The first GET sends this many bytes a second (0: as fast as it can).
        self.slow_first_get = 0
        # (method, path, Range header) of every request.
        self.requests: list[tuple[str, str, str | None]] = []
        # (method, path, Authorization header) of every request.
        self.authorizations: list[tuple[str, str, str | None]] = []
        self.no_sha256 = False
        # An HTTP status the API answers with instead of the metadata (0: none).
        self.api_error = 0
        # Downloads answer 302 to this base URL + the same path (None: served here).
        self.redirect_to: str | None = None
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def _note(self) -> None:
                hub.requests.append((self.command, self.path, self.headers.get("Range")))
                auth = self.headers.get("Authorization")
                hub.authorizations.append((self.command, self.path, auth))

            def _redirected(self) -> bool:
                if hub.redirect_to is None or "/resolve/" not in self.path:
                    return False
                self.send_response(302)
                self.send_header("Location", hub.redirect_to + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return True

            def _file(self) -> bytes | None:
                match = _RESOLVE.match(self.path.split("?")[0])
                return hub.files.get((match["repo"], match["name"])) if match else None

            def _headers_for(self, data: bytes) -> None:
                sha = hashlib.sha256(data).hexdigest()
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("X-Linked-Etag", f'"{sha}"')
                self.send_header("ETag", f'"{sha}"')
                self.send_header("X-Linked-Size", str(len(data)))

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                self._note()
                if self._redirected():
                    return
                data = self._file()
                if data is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self._headers_for(data)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                self._note()
                if self.path.startswith("/api/models/"):
                    self._api()
                    return
                if self._redirected():
                    return
                data = self._file()
                if data is None:
                    self.send_error(404)
                    return
                wanted = self.headers.get("Range")
                start = int(re.match(r"bytes=(\d+)-", wanted).group(1)) if wanted else 0
                self.send_response(206 if wanted else 200)
                if wanted:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self._headers_for(data)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                rate, hub.slow_first_get = hub.slow_first_get, 0
                try:
                    if not rate:
                        self.wfile.write(body)
                        return
                    step = max(1, rate // 20)
                    for at in range(0, len(body), step):
                        self.wfile.write(body[at : at + step])
                        self.wfile.flush()
                        time.sleep(0.05)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away mid-file

            def do_POST(self) -> None:  # noqa: N802
                self._note()
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._api()

            def _api(self) -> None:
                if hub.api_error:
                    self.send_error(hub.api_error)
                    return
                match = re.match(r"^/api/models/(?P<repo>[^/]+/[^/]+)", self.path)
                repo = match["repo"] if match else ""
                items = []
                for (owner, name), data in hub.files.items():
                    if owner != repo:
                        continue
                    sha = "0" * 64 if hub.wrong_sha256 else hashlib.sha256(data).hexdigest()
                    size = hub.claimed_size or len(data)
                    lfs = {"oid": sha, "sha256": sha, "size": size, "pointerSize": 130}
                    if hub.no_sha256:
                        lfs = None
                    items.append(
                        {
                            "type": "file",
                            "path": name,
                            "rfilename": name,
                            "size": size,
                            "oid": "b" * 40,
                            "lfs": lfs,
                        }
                    )
                if "/paths-info/" in self.path:
                    body = json.dumps(items).encode()
                else:
                    body = json.dumps({"id": repo, "sha": COMMIT, "siblings": items}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler
