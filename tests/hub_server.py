"""A Hugging Face Hub on 127.0.0.1 that implements the endpoints ``huggingface_hub``'s ``create_repo`` and
``upload_folder`` call (without hf_xet: ``HF_HUB_DISABLE_XET=1``), and records what it receives:

* ``POST /api/repos/create``: the repository (name, organization, visibility);
* ``POST /api/validate-yaml``: the model card's front matter, checked as YAML;
* ``POST /api/models/{repo}/preupload/{revision}``: each file's upload mode (``*.safetensors`` by LFS, the rest as
  regular files, as the Hub decides by its rules);
* ``POST /{repo}.git/info/lfs/objects/batch``: the basic transfer, an upload and a verify action per object;
* ``PUT /lfs/{oid}``: the object's bytes, whose sha256 must be its oid; ``POST /lfs-verify``: oid and size;
* ``POST /api/models/{repo}/commit/{revision}``: the NDJSON commit (a header, then ``file`` entries in base64 and
  ``lfsFile`` entries by oid), resolved into the repository's files.

Anything else is answered 404 and recorded in ``unexpected``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml


class HubState:
    def __init__(self):
        self.created: list[dict] = []
        self.cards: list[str] = []
        self.objects: dict[str, bytes] = {}  # LFS objects by sha256
        self.files: dict[str, dict[str, bytes]] = {}  # repo -> path -> bytes, as committed
        self.lfs_paths: set[str] = set()
        self.commits: list[dict] = []
        self.tokens: set[str] = set()
        self.unexpected: list[str] = []
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    @property
    def hub(self) -> HubState:
        return self.server.hub  # type: ignore[attr-defined]

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            data = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _reply(self, status: int, payload: dict | None = None) -> None:
        body = json.dumps(payload if payload is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _endpoint(self) -> str:
        return f"http://{self.server.server_address[0]}:{self.server.server_address[1]}"

    def _route(self, method: str) -> None:
        body = self._body()
        path = self.path.split("?")[0]
        with self.hub.lock:
            if self.headers.get("Authorization"):
                self.hub.tokens.add(self.headers["Authorization"])
        if method == "POST" and path == "/api/repos/create":
            payload = json.loads(body)
            with self.hub.lock:
                self.hub.created.append(payload)
            return self._reply(200, {"url": f"{self._endpoint()}/{payload['organization']}/{payload['name']}"})
        if method == "POST" and path == "/api/validate-yaml":
            content = json.loads(body)["content"]
            front = re.match(r"^---\n(.*?)\n---\n", content, re.DOTALL)
            if front is None or not isinstance(yaml.safe_load(front.group(1)), dict):
                return self._reply(400, {"errors": [{"message": "no YAML front matter"}]})
            with self.hub.lock:
                self.hub.cards.append(content)
            return self._reply(200, {"errors": [], "warnings": []})
        match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/([^/]+)", path)
        if method == "POST" and match:
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [
                {"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                 "shouldIgnore": False} for f in files]})
        match = re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
        if method == "POST" and match:
            request = json.loads(body)
            assert request["operation"] == "upload" and "basic" in request["transfers"]
            return self._reply(200, {"transfer": "basic", "objects": [
                {"oid": o["oid"], "size": o["size"],
                 "actions": {"upload": {"href": f"{self._endpoint()}/lfs/{o['oid']}"},
                             "verify": {"href": f"{self._endpoint()}/lfs-verify"}}}
                for o in request["objects"]]})
        match = re.fullmatch(r"/lfs/([0-9a-f]{64})", path)
        if method == "PUT" and match:
            if hashlib.sha256(body).hexdigest() != match.group(1):
                return self._reply(400, {"error": "sha256 mismatch"})
            with self.hub.lock:
                self.hub.objects[match.group(1)] = body
            return self._reply(200)
        if method == "POST" and path == "/lfs-verify":
            request = json.loads(body)
            stored = self.hub.objects.get(request["oid"])
            return self._reply(200 if stored is not None and len(stored) == request["size"] else 404)
        match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/([^/]+)", path)
        if method == "POST" and match:
            repo = match.group(1)
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            with self.hub.lock:
                files = self.hub.files.setdefault(repo, {})
                for line in lines:
                    value = line["value"]
                    if line["key"] == "file":
                        assert value["encoding"] == "base64"
                        files[value["path"]] = base64.b64decode(value["content"])
                    elif line["key"] == "lfsFile":
                        assert value["algo"] == "sha256"
                        files[value["path"]] = self.hub.objects[value["oid"]]
                        self.hub.lfs_paths.add(value["path"])
                self.hub.commits.append(lines[0]["value"])
            oid = "0" * 40
            return self._reply(200, {"commitUrl": f"{self._endpoint()}/{repo}/commit/{oid}", "commitOid": oid})
        with self.hub.lock:
            self.hub.unexpected.append(f"{method} {self.path}")
        return self._reply(404, {"error": "not implemented by the test hub"})

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def do_PUT(self):
        self._route("PUT")


class HubServer:
    """``with HubServer() as hub:`` a test hub on a free port of 127.0.0.1; ``hub.url`` for ``HF_ENDPOINT``,
    ``hub.state`` what it received."""

    def __init__(self):
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.hub = HubState()  # type: ignore[attr-defined]
        self.state: HubState = self.server.hub  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
