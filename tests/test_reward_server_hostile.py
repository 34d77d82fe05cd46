"""The reward server against hostile input (issue 41: 1b, 1c, 1d, 6): files outside the allow-listed root, images
that decompress to gigabytes, a fuzz run of malformed requests, and a training run whose server starts refusing its
token. Every server is a real one on 127.0.0.1 (a ``flowalign serve-reward`` subprocess, or the server class on a
thread of this process), stopped by its own process id; its memory is read from ``/proc/<pid>/status``."""

from __future__ import annotations

import asyncio
import base64
import collections
import http.client
import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from flowalign.config import ConfigError
from flowalign.memory.resident import reset_peak, resident
from flowalign.remote.wire import encode_request
from flowalign.rewards import build_reward

from test_remote_rewards import HOST, TOKEN, Server

REPO = Path(__file__).resolve().parents[1]
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ST, JSON = "application/x-safetensors", "application/json"
MIB = 2**20


# ------------------------------------------------------------------------------------------ helpers
def flat_png(width: int, height: int) -> bytes:
    """An 8-bit RGB PNG of one flat colour, written row by row (a 6000 x 6000 one is ~100 kB and never exists
    decoded in this process)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer, row, parts = zlib.compressobj(9), b"\x00" + b"\x80\x40\x20" * width, []
    for _ in range(height):
        parts.append(packer.compress(row))
    parts.append(packer.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")


def png_request(pngs: list[bytes], reward: str = "brightness") -> bytes:
    return json.dumps({"rewards": [reward], "prompts": ["x"] * len(pngs), "metadata": [{}] * len(pngs),
                       "images_png": [base64.b64encode(p).decode() for p in pngs]}).encode()


def send(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         timeout: float = 30) -> int | None:
    """The status of one HTTP request, or None when the server closed the connection without an answer."""
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        answer = connection.getresponse()
        answer.read()
        return answer.status
    except (ConnectionError, http.client.HTTPException):
        return None
    finally:
        connection.close()


def send_raw(port: int, data: bytes, *, wait: float = 0.0, timeout: float = 10) -> int | None:
    """The status the server answers to raw bytes (after ``wait`` seconds of silence), or None for no answer."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            if wait:
                time.sleep(wait)
            answer = b""
            while b"\r\n" not in answer:
                piece = sock.recv(4096)
                if not piece:
                    break
                answer += piece
        except (ConnectionError, socket.timeout):
            return None
    found = re.match(rb"HTTP/1\.[01] (\d{3})", answer)
    return int(found.group(1)) if found else None


def safetensors_body(header: dict, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A files root with a source image, a text file and a symlink out of it; a secret image beside it."""
    from PIL import Image

    base = tmp_path_factory.mktemp("files")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / "src.png")
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(outside / "secret.png")
    (root / "notes.txt").write_text("not an image")
    (root / "escape.png").symlink_to(outside / "secret.png")
    return root, outside / "secret.png"


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory, files):
    """A server without image_size, with a token, a 2 MiB body limit, a 1 s read timeout and a files root."""
    root, _ = files
    running = Server(tmp_path_factory.mktemp("hostile-server"), image_size=None, rewards=[
        {"name": "toy_geneval"}, {"name": "brightness"}, {"name": "source_similarity"}],
        files_root=str(root), max_request_mb=2, read_timeout=1.0)
    yield running
    running.stop()


def similarity_request(paths, images: torch.Tensor, encoding: str = "safetensors") -> tuple[bytes, str]:
    return encode_request(["source_similarity"], images, ["edit"] * len(images),
                          [{"images": p} for p in paths], encoding=encoding)


# ------------------------------------------------------------------------------------------ 1b: files
def test_a_reward_that_reads_files_is_served_only_under_a_files_root(tmp_path):
    from flowalign.cli import parse_command

    with pytest.raises(ConfigError, match=r"rewards\[0\].name = 'source_similarity' opens the files that a request's "
                                          r"metadata names \(images\): serve it only with files_root"):
        parse_command(["serve-reward", "rewards=[{name: source_similarity}]"])
    with pytest.raises(ConfigError, match="files_root = .* is not a directory"):
        parse_command(["serve-reward", "rewards=[{name: source_similarity}]", f"--files-root={tmp_path / 'none'}"])
    _, config = parse_command(["serve-reward", "rewards=[{name: source_similarity}]", f"--files-root={tmp_path}"])
    assert config.files_root == str(tmp_path)


def test_paths_outside_the_files_root_are_refused_alike_and_name_no_server_path(hostile_server, files):
    """A path outside the root (``..``, absolute, through a symlink) and a missing file inside it get the same 400,
    which names no path of the server; a file under the root is scored as in process."""
    root, secret = files
    images = torch.rand(1, 3, 16, 16)
    local = build_reward("source_similarity")(images, ["edit"], [{"images": [str(root / "src.png")]}])
    url = f"{hostile_server.url}/v1/score"
    for inside in (["src.png"], [str(root / "src.png")], ["./sub/../src.png"]):
        body, kind = similarity_request([inside], images)
        answer = json.loads(_post(url, body, kind)[1])
        assert answer["scores"]["source_similarity"] == [pytest.approx(float(local[0]), abs=0)], inside
    refusals = set()
    for refused in (["../outside/secret.png"], [str(secret)], ["escape.png"], ["missing.png"], ["/etc/passwd"],
                    ["../../../../../../etc/passwd"], [str(root)], ["src.png\x00"], [7]):
        for encoding in ("safetensors", "png"):
            status, message = _post(url, *similarity_request([refused], images, encoding))
            assert status == 400, (refused, status, message)
            assert str(root.parent) not in message and "secret" not in message and "passwd" not in message
            refusals.add(message.split(": HTTP 400: ", 1)[1])
    assert refusals == {"metadata[0]['images'][0] does not name a readable file under the server's files_root "
                        "(give a path relative to that directory)"}
    status, message = _post(url, *similarity_request([["notes.txt"]], images))  # under the root, not an image
    assert status == 422 and "cannot be read as an image (UnidentifiedImageError)" in message
    assert str(root) not in message


def _post(url: str, body: bytes, kind: str) -> tuple[int, str]:
    from flowalign.remote.transport import RequestError, request

    try:
        answer = request(url, data=body, headers={**AUTH, "Content-Type": kind}, timeout=60)
        return answer.status, answer.body.decode()
    except RequestError as error:
        return error.status, str(error)


# ------------------------------------------------------------------------------------------ 1c: decompression bombs
def test_a_decompression_bomb_is_refused_from_its_header_and_memory_stays_flat(hostile_server, tmp_path):
    """A ~100 kB PNG of 36 Mpx (6000 x 6000) and a safetensors header claiming 10^10 pixels are refused with 413
    before any pixel is decoded, three at once: the server's peak RSS grows by less than 50 MiB (it grew by 931 MiB
    before). A server with ``--image-size 64 --max-request-mb 1`` refuses an 8000 x 8000 PNG from its header too
    (413), and a 2000 x 2000 one for its size (422), without decoding either."""
    bomb = flat_png(6000, 6000)
    assert len(bomb) < 200_000
    huge = safetensors_body({"__metadata__": {"flowalign": json.dumps({"rewards": ["brightness"], "prompts": ["x"]})},
                             "images": {"dtype": "F32", "shape": [1, 3, 100_000, 100_000], "data_offsets": [0, 0]}})
    small = Server(tmp_path, image_size=64, max_request_mb=1, name="small", rewards=[{"name": "brightness"}])
    try:
        for running, body, kind, status in ((hostile_server, png_request([bomb]), JSON, 413),
                                            (hostile_server, png_request([bomb] * 3), JSON, 413),
                                            (hostile_server, huge, ST, 413),
                                            (small, png_request([flat_png(8000, 8000)]), JSON, 413),
                                            (small, png_request([bomb]), JSON, 413),
                                            (small, png_request([flat_png(2000, 2000)]), JSON, 422)):
            before = reset_peak(running.pid)
            with ThreadPoolExecutor(3) as pool:  # three at once
                answers = list(pool.map(lambda _: _post(f"{running.url}/v1/score", body, kind), range(3)))
            grown = resident(running.pid)["VmHWM"] - before
            assert all(code == status for code, _ in answers), answers
            print(f"\nbomb {status}: peak RSS +{grown / MIB:.1f} MiB")
            assert grown < 50 * MIB, f"peak RSS grew by {grown / MIB:.1f} MiB"
    finally:
        small.stop()


# ------------------------------------------------------------------------------------------ 1d: the fuzz run
def _fuzz_cases(files, port: int) -> list[tuple[str, tuple]]:
    """``(category, case)``: ``case`` is ``(method, path, body, headers)`` for ``send``, or ``(bytes, wait)`` for
    ``send_raw``. Deterministic (seeded)."""
    root, secret = files
    rng = random.Random(41)
    images = torch.rand(2, 3, 16, 16)
    prompts, metadata = ["a red circle", "two squares"], [{}, {}]
    good_st, _ = encode_request(["brightness"], images, prompts, metadata)
    good_png, _ = encode_request(["brightness"], images, prompts, metadata, encoding="png")
    cases: list[tuple[str, tuple]] = []

    def score(category, body, kind=ST, headers=AUTH):
        cases.append((category, ("POST", "/v1/score", body, {**headers, "Content-Type": kind})))

    for kind in ("", "text/plain", "application/octet-stream", "multipart/form-data; boundary=x", "image/png",
                 "application/x-www-form-urlencoded", "application/xml", "*/*", "APPLICATION/X-SAFETENSORS",
                 "application/json; charset=latin-1", "application/x-safetensors; q=0.1", "application/jsonx"):
        for body in (good_st, good_png, b""):
            score("content type", body, kind)
    for cut in rng.sample(range(len(good_st)), 50):
        score("truncated safetensors", good_st[:cut])
    for cut in rng.sample(range(len(good_png)), 50):
        score("truncated json", good_png[:cut], JSON)
    for body, kind, count in ((good_st, ST, 60), (good_png, JSON, 40)):
        for _ in range(count):
            mutated = bytearray(body)
            for _ in range(rng.randint(1, 8)):
                where = rng.randrange(min(len(body), 400)) if rng.random() < 0.7 else rng.randrange(len(body))
                mutated[where] = rng.randrange(256)
            score("mutated", bytes(mutated), kind)
    request_fields = {"rewards": ["brightness"], "prompts": prompts, "metadata": metadata,
                      "images_png": json.loads(good_png)["images_png"]}
    bad_json = [b"", b"null", b"[]", b"{}", b'"x"', b"1e999", b"[" * 100_000, b'{"a":' * 50_000, b"\xff\xfe\x00",
                b"NaN", b"{" + b'"k": 1, ' * 10_000 + b'"rewards": 5}']
    for key, values in (("rewards", ["brightness", [], [1], [None], ["nope"], ["brightness"] * 1000, {"a": 1}]),
                        ("prompts", ["x", [1, 2], None, ["x"], ["x"] * 3, [["x"]] * 2]),
                        ("metadata", ["x", ["x", "y"], [1, 2], [{}] * 3, {"a": 1}, [None, None]]),
                        ("group_ids", ["x", [True, False], [1.5, 2], [1]]),
                        ("images_png", ["x", [], [1], ["%%%"], [""], ["AAAA"], None, [good_png.decode()[:100]]])):
        for value in values:
            bad_json.append(json.dumps({**request_fields, key: value}).encode())
    for body in bad_json:
        score("bad json", body, JSON)

    meta = lambda request: {"flowalign": json.dumps(request)}  # noqa: E731
    plain = {"rewards": ["brightness"], "prompts": ["x"], "metadata": [{}]}
    tensor = {"dtype": "F32", "shape": [1, 3, 2, 2], "data_offsets": [0, 48]}
    crafted = [
        {"__metadata__": "flowalign", "images": tensor}, {"__metadata__": ["flowalign"], "images": tensor},
        {"__metadata__": 5, "images": tensor}, {"__metadata__": None, "images": tensor},
        {"__metadata__": {"flowalign": 7}, "images": tensor}, {"__metadata__": {"flowalign": None}, "images": tensor},
        {"__metadata__": {"flowalign": {"rewards": ["brightness"]}}, "images": tensor},
        {"__metadata__": {"flowalign": "{"}, "images": tensor}, {"__metadata__": {"flowalign": "[]"}, "images": tensor},
        {"__metadata__": meta(plain)}, {"__metadata__": meta(plain), "images": "x"},
        {"__metadata__": meta(plain), "images": tensor, "other": tensor},
        {"__metadata__": meta({**plain, "prompts": ["x", "y"]}), "images": tensor},
    ]
    for dtype in ("I64", "F8_E4M3", "", None, 3, "BOOL"):
        crafted.append({"__metadata__": meta(plain), "images": {**tensor, "dtype": dtype}})
    for shape in ([-1, 3, 2, 2], [1, 3, 100_000, 100_000], [10**12, 3, 1, 1], [1, 3], [1, 4, 2, 2], [0, 3, 2, 2],
                  ["a", 3, 2, 2], [True, 3, 2, 2], [1, 3, 2**40, 2**40], [1, 3, 0, 5], 12, None):
        crafted.append({"__metadata__": meta(plain), "images": {**tensor, "shape": shape}})
    for offsets in ([0, 10**18], [5, 2], [0, 47], [-1, 47], "x", [0]):
        crafted.append({"__metadata__": meta(plain), "images": {**tensor, "data_offsets": offsets}})
    for header in crafted:
        score("crafted safetensors", safetensors_body(header, bytes(48)))
    for prefix in (struct.pack("<Q", 2**63), struct.pack("<Q", 0), struct.pack("<Q", 10), b"\x00" * 3):
        score("crafted safetensors", prefix + b'{"a": 1}' + bytes(8))
    score("crafted safetensors", struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc")

    bomb = flat_png(6000, 6000)
    for body, kind in ((png_request([bomb]), JSON), (png_request([flat_png(1, 40_000_000 // 1)]), JSON),
                       (png_request([flat_png(8, 8), flat_png(16, 16)]), JSON), (os.urandom(3 * MIB), ST),
                       (os.urandom(3 * MIB), JSON), (b"{" + b" " * (3 * MIB) + b"}", JSON),
                       (png_request([flat_png(1, 1)] * 20_000), JSON)):
        score("oversized", body, kind)

    for path in ("/../../etc/passwd", "/v1/../v1/score", "/v1/score/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd",
                 "/v1/%2e%2e/health", "//etc/passwd", "/v1/metadata/../../../", "/static/../../../../etc/shadow",
                 "/v1/score?path=../../etc/passwd", "/v1/score%00", "/v1/score;../../", "/health/../v1/metadata",
                 "/" + "a" * 5000, "/v1/score/", "/V1/SCORE", "/v1/score%2f..%2f..%2fetc%2fpasswd",
                 f"/{root}/src.png", f"/..{secret}", "/.env", "/v1/metadata?" + "x=1&" * 500):
        for method in ("GET", "POST"):
            for headers in (AUTH, {}):
                cases.append(("url traversal", (method, path, good_st if method == "POST" else None,
                                                {**headers, "Content-Type": ST})))

    for paths in (["../outside/secret.png"], [str(secret)], ["escape.png"], ["missing.png"], ["notes.txt"],
                  ["/etc/passwd"], ["/proc/self/environ"], ["src.png\x00.txt"], ["a" * 10_000], [""], [None], [1],
                  "src.png", {"x": 1}, ["~/.ssh/id_rsa"], ["file:///etc/passwd"], ["..\\..\\etc\\passwd"],
                  ["%2e%2e/%2e%2e/etc/passwd"], ["src.png/../../outside/secret.png"], [str(root)], [],
                  ["src.png"] * 50, ["./src.png"]):
        for encoding in ("safetensors", "png"):
            body, kind = similarity_request([paths], torch.rand(1, 3, 16, 16), encoding)
            score("metadata traversal", body, kind)

    toy = [{"tag": "single_object", "prompt": "a circle", "include": [{"class": "circle", "count": 1}]}]
    for entry in ({}, {"tag": 5}, {**toy[0], "tag": "nope"}, {k: v for k, v in toy[0].items() if k != "include"},
                  {**toy[0], "include": "circle"}, {**toy[0], "include": [{"class": "circle", "count": -1}]},
                  {**toy[0], "include": [{"class": "circle", "count": 1, "position": ["left of", 9]}]},
                  {**toy[0], "exclude": 5}, toy[0]):
        for encoding in ("safetensors", "png"):
            body, kind = encode_request(["toy_geneval"], images[:1], ["a circle"], [entry], encoding=encoding)
            score("reward input", body, kind)
    for rewards in (["nope"], ["brightness", "nope"], ["../brightness"], ["brightness"] * 3):
        score("reward input", encode_request(rewards, images, prompts, metadata)[0])

    for value in (None, "Bearer", "Bearer ", "Bearer wrong", f"bearer {TOKEN}", f"Basic {TOKEN}", f"Bearer {TOKEN}x",
                  f"Bearer {TOKEN[:-1]}", "Bearer " + "t" * 100_00, f"Bearer  {TOKEN}", TOKEN):
        headers = {} if value is None else {"Authorization": value}
        for method, path, body in (("GET", "/health", None), ("GET", "/v1/metadata", None),
                                   ("POST", "/v1/score", good_st)):
            cases.append(("token", (method, path, body, {**headers, "Content-Type": ST})))
    for method in ("PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE"):
        for path in ("/v1/score", "/health", "/v1/metadata"):
            cases.append(("method", (method, path, None, AUTH)))
    cases.append(("method", ("GET", "/v1/score", None, AUTH)))

    start = f"POST /v1/score HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: Bearer {TOKEN}\r\n".encode()
    for raw in (b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
                b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
                b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"b" * 100) for i in range(300)) + b"\r\n",
                b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n", b"GET /health HTTP/1.1\r\nX-Bad: a\x00b\r\n\r\n",
                b"GET /health HTTP/1.1\r\nX-Bad: \xff\xfe\r\n\r\n", b"GARBAGE\r\n\r\n", b"GET /\r\n\r\n",
                b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64),
                start + b"Content-Length: -1\r\n\r\n", start + b"Content-Length: abc\r\n\r\n",
                start + b"Content-Length: 99999999999999999999\r\n\r\n",
                start + b"Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\nzz\r\nxx\r\n0\r\n\r\n",
                start + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
                b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n", b"GET /health HTTP/9.9\r\n\r\n",
                start + b"Content-Type: application/json\r\nContent-Length: 10\r\n\r\n{}"):
        cases.append(("raw http", (raw, 0.0)))
    for _ in range(4):  # slow uploads: part of the body, then silence beyond read_timeout
        cases.append(("slow upload", (start + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{",
                                      2.0)))
    return cases


def test_fuzz_hostile_requests_get_no_5xx_memory_stays_bounded_and_the_server_still_scores(hostile_server, files):
    """At least 500 malformed, truncated, oversized and hostile requests (content types, bad JSON, crafted
    safetensors headers, decompression bombs, path traversal in URLs and metadata, huge headers, absent or wrong
    tokens, slow uploads): no answer is a 5xx, the server's peak RSS grows by less than 100 MiB, and it still scores
    a good request at the end. The figures are printed (docs/guides/rewards.md quotes them)."""
    port = hostile_server.port
    cases = _fuzz_cases(files, port)
    assert len(cases) >= 500
    before = reset_peak(hostile_server.pid)
    statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    started = time.monotonic()

    def run(item):
        category, case = item
        if category in ("raw http", "slow upload"):
            return category, send_raw(port, case[0], wait=case[1])
        return category, send(port, *case)

    slow = [item for item in cases if item[0] == "slow upload"]
    with ThreadPoolExecutor(len(slow)) as pool:  # the slow ones at once, beside the others
        pending = [pool.submit(run, item) for item in slow]
        for category, status in map(run, [item for item in cases if item[0] != "slow upload"]):
            statuses[category][status] += 1
        for future in pending:
            category, status = future.result()
            statuses[category][status] += 1
    elapsed = time.monotonic() - started
    peak = resident(hostile_server.pid)["VmHWM"]
    total = collections.Counter()
    for counter in statuses.values():
        total.update(counter)
    print(f"\nfuzz: {len(cases)} requests in {elapsed:.1f} s; by status {dict(sorted(total.items(), key=str))}; "
          f"RSS {before / MIB:.0f} MiB before, peak {peak / MIB:.0f} MiB (+{(peak - before) / MIB:.1f} MiB)")
    for category, counter in statuses.items():
        print(f"  {category}: {dict(sorted(counter.items(), key=str))}")
    fives = {category: {s: n for s, n in counter.items() if s is not None and s >= 500}
             for category, counter in statuses.items()}
    assert not any(fives.values()), fives
    assert statuses["slow upload"] == {408: 4}
    assert peak - before < 100 * MIB
    assert hostile_server.process.poll() is None
    images = torch.rand(2, 3, 16, 16)
    body, kind = encode_request(["brightness"], images, ["a", "b"], [{}, {}])
    status, answer = _post(f"{hostile_server.url}/v1/score", body, kind)
    assert status == 200 and json.loads(answer)["scores"]["brightness"] == pytest.approx(
        images.flatten(1).mean(1).tolist())


# ------------------------------------------------------------------------------------------ 6: a permanent 401 mid-run
class ThreadedRewardServer:
    """``flowalign.remote.server`` on a thread of this process (so a test can change its token mid-run)."""

    def __init__(self, rewards: list[tuple[str, object]], token: str, port_file: Path):
        from flowalign.remote.server import RewardServer, ServeRewardConfig, _serve

        config = ServeRewardConfig(host=HOST, port=0, port_file=str(port_file), batch_size=8, threads=1,
                                   shutdown_timeout=5)
        self.server = RewardServer(config, rewards, token=token)
        self.loop, self.ready = asyncio.new_event_loop(), threading.Event()
        self.stop_event: asyncio.Event | None = None

        async def main():
            self.stop_event = asyncio.Event()
            await _serve(self.server, config, self.ready, self.stop_event)

        self.thread = threading.Thread(target=lambda: self.loop.run_until_complete(main()), daemon=True)
        self.thread.start()
        assert self.ready.wait(60)
        self.port = int(port_file.read_text())
        self.url = f"http://{HOST}:{self.port}"

    def stop(self):
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(30)


def test_a_401_in_the_middle_of_a_run_stops_it_cleanly_with_its_checkpoint(tmp_path):
    """Issue 41 (6, High): ``flowalign train`` scores with a remote reward; after its first iteration the server's
    token changes, so the next request is answered 401. The run saves its checkpoint, prints one line naming the URL
    and the status (the last line of stderr, after the progress bars), and exits 1, without a traceback."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    served = ThreadedRewardServer([("brightness", build_reward("brightness"))], TOKEN, tmp_path / "port")
    run = tmp_path / "run"
    reward = [{"name": "remote", "kwargs": {"url": served.url, "reward": "brightness", "token_file": str(token_file),
                                            "retries": 2, "backoff": 0.01}}]
    values = {"model.path": str(REPO / "assets/toy-sd3"), "reward.rewards": json.dumps(reward),
              "data.prompts_per_iteration": 2, "data.group_size": 4, "sampling.num_steps": 4,
              "sampling.batch_size": 4, "train.iterations": 50, "train.checkpoint_every": 0, "train.tracker": "none",
              "train.eval_at_end": "false", "train.sample_every": 0, "train.out_dir": str(run)}
    process = subprocess.Popen([str(Path(sys.executable).parent / "flowalign"), "train",
                                *[f"{k}={v}" for k, v in values.items()]], cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 240
        while served.server.served["requests"] < 1 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        served.server.token = "rotated"  # from now on every request is answered 401
        stdout, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
        served.stop()
    assert process.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    lines = [line for line in stderr.strip().splitlines() if "flowalign:" in line]  # beside progress bars
    assert len(lines) == 1 and stderr.strip().endswith(lines[0]), stderr[-3000:]
    assert re.fullmatch(rf"flowalign: stopped: remote reward 'brightness': the server at {served.url}/v1/score "
                        r"answered HTTP 401 \(unauthorized: wrong bearer token .*\), which retrying cannot fix: .*; "
                        r"the run stopped in iteration (\d+) with checkpoint-0*\1 saved: resume with "
                        r"train.resume=latest once that is fixed", lines[0]), lines[0]
    done = int(re.search(r"iteration (\d+)", lines[0]).group(1))
    checkpoint = run / f"checkpoint-{done:06d}"
    assert done >= 1 and (checkpoint / "trainable.safetensors").is_file()
    assert json.loads((checkpoint / "state.json").read_text())["iteration"] == done
