"""Rewards out of process: the reward server (`flowalign serve-reward`) in a subprocess on 127.0.0.1, the `remote`
reward against it, the flow_grpo pickle protocol behind its opt-in, and the VLM judge against a local
chat-completions server with deterministic answers. Every server listens on 127.0.0.1 only, every request has a
timeout, and every subprocess is stopped by its own id."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import math
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from flowalign.config import load_config
from flowalign.data.prompts import load_prompts
from flowalign.errors import SetupError
from flowalign.remote.transport import CircuitBreaker, RequestError, Retrying, TransientError, request
from flowalign.remote.wire import decode_request, encode_request
from flowalign.rewards import build_reward, check_reward_run
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from golden_runs import torch_threads

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
TOKEN = "s3cret-token"

# The server process: the CLI, plus a test reward that sleeps as long as its metadata says (a slow server).
SERVER = """
import sys, time
import flowalign

class Sleepy:
    name = "sleepy"
    def __call__(self, images, prompts, metadata):
        time.sleep(max(float(m.get("sleep", 0)) for m in metadata))
        return images.flatten(1).mean(1)

flowalign.register_reward("sleepy", Sleepy)
from flowalign.cli import main
main(sys.argv[1:])
"""


class Server:
    """A reward server subprocess on 127.0.0.1, stopped by its own process id."""

    def __init__(self, directory: Path, *, port: int = 0, image_size: int | None = 32, token: bool = True,
                 batch_size: int = 8, name: str = "server", rewards: list[dict] | None = None, **settings):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.token_file = directory / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.port_file = directory / f"{name}.port"
        self.port_file.unlink(missing_ok=True)
        config = {
            "rewards": [{"name": "toy_geneval", "kwargs": {"partial_credit": True}}, {"name": "toy_geneval_soft"},
                        {"name": "brightness"}, {"name": "sleepy"}],
            "host": HOST, "port": port, "port_file": str(self.port_file), "batch_size": batch_size,
            "image_size": image_size, "token_file": str(self.token_file) if token else None,
            "shutdown_timeout": 20, "threads": 1, **settings,
        }
        if rewards is not None:
            config["rewards"] = rewards
        path = directory / f"{name}.yaml"
        path.write_text(json.dumps(config))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.log = open(directory / f"{name}.log", "w")
        self.process = subprocess.Popen([sys.executable, "-c", SERVER, "serve-reward", str(path)], cwd=REPO,
                                        env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self.port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the reward server did not start: {(directory / f'{name}.log').read_text()}")
            time.sleep(0.1)
        self.port = int(self.port_file.read_text())
        self.url = f"http://{HOST}:{self.port}"
        self.pid = self.process.pid

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()
        return self.process.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = Server(tmp_path_factory.mktemp("reward-server"))
    yield running
    running.stop()


def auth() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}


def toy_batch(count: int, seed: int = 0):
    """Images of the toy world: exact scenes for half the prompts, noise for the rest (so scores vary)."""
    from flowalign.toy.scenes import render, scene_for

    prompts = load_prompts(REPO / "assets/prompts/train.jsonl")
    rng = np.random.default_rng(seed)
    metadata = [prompts[int(i)] for i in rng.integers(0, len(prompts), count)]
    images = []
    for i, entry in enumerate(metadata):
        if i % 2 == 0:
            images.append(torch.from_numpy(render(scene_for(entry, rng))).permute(2, 0, 1).float() / 255)
        else:
            images.append(torch.from_numpy(rng.random((3, 32, 32), dtype=np.float32)))
    return torch.stack(images), [m["prompt"] for m in metadata], metadata


def remote(server, reward, **kwargs):
    return build_reward("remote", url=server.url, reward=reward, token_file=str(server.token_file), **kwargs)


# ------------------------------------------------------------------------------------------ the server
@pytest.mark.parametrize("name, kwargs", [("toy_geneval", {"partial_credit": True}), ("toy_geneval_soft", {}),
                                          ("brightness", {})])
def test_remote_scores_equal_in_process_scores_bit_for_bit(server, name, kwargs):
    images, prompts, metadata = toy_batch(20)
    reward = build_reward(name, **kwargs)
    if name == "toy_geneval_soft":
        # a network: its float32 rounding depends on the batch it runs in and on the thread count, so the in-process
        # reference scores the batches the server scores (requests of 8, one at a time: none merged) in the server's
        # one thread (with two, under pytest -n 0, the sums split differently)
        with torch_threads(1):
            local = torch.cat([reward(images[i:i + 8], prompts[i:i + 8], metadata[i:i + 8]) for i in range(0, 20, 8)])
        client = remote(server, name, batch_size=8, concurrency=1)
    else:  # one image at a time, whatever the batch: any split and merge of the requests gives the same scores
        local = torch.as_tensor(reward(images, prompts, metadata), dtype=torch.float32)
        client = remote(server, name, batch_size=6)  # 4 requests at once, merged by the server up to 8 images
    scores = client(images, prompts, metadata)
    assert scores.dtype == torch.float32 and torch.equal(scores, local), (scores, local)
    assert local.unique().numel() > 1  # the batch tells the images apart


def test_png_encoding_scores_the_8_bit_images(server):
    images, prompts, metadata = toy_batch(6)
    quantised = (images * 255).round() / 255
    scores = remote(server, "brightness", encoding="png")(images, prompts, metadata)
    assert torch.equal(scores, build_reward("brightness")(quantised, prompts, metadata))


def test_health_and_metadata(server):
    assert request(f"{server.url}/health", timeout=10).json()["status"] == "ok"  # no token needed
    meta = request(f"{server.url}/v1/metadata", headers=auth(), timeout=10).json()
    assert sorted(meta["rewards"]) == ["brightness", "sleepy", "toy_geneval", "toy_geneval_soft"]
    assert meta["image_size"] == [32, 32] and meta["batch_size"] == 8 and meta["protocol"] == 1
    assert meta["rewards"]["toy_geneval"]["kwargs"] == {"partial_credit": True}
    assert meta["rewards"]["toy_geneval"]["version"].startswith("flowalign ")


def test_concurrent_clients_all_get_their_own_scores(server):
    images, prompts, metadata = toy_batch(16, seed=1)
    expected = build_reward("brightness")(images, prompts, metadata)
    client = remote(server, "brightness")

    def worker(k: int) -> bool:
        ok = True
        for r in range(50):
            i = (k * 50 + r) % 15
            ok &= torch.equal(client(images[i:i + 2], prompts[i:i + 2], metadata[i:i + 2]), expected[i:i + 2])
        return ok

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(worker, range(8)))
    assert client.failed == 0


def test_malformed_requests_get_a_4xx_with_a_message(server):
    images, prompts, metadata = toy_batch(2)
    url, headers = f"{server.url}/v1/score", auth()
    body, kind = encode_request(["brightness"], images, prompts, metadata)
    cases = [
        (b"{not json", "application/json", 400, "not JSON"),
        (b"abc", "text/plain", 415, "Content-Type"),
        (b"\x01\x00\x00\x00\x00\x00\x00\x00{", "application/x-safetensors", 400, "header is not JSON"),
        (encode_request(["pickscore"], images, prompts, metadata)[0], kind, 404, "not served here"),
        (encode_request(["brightness"], images, prompts[:1], metadata[:1])[0], kind, 400, "2 images and 1 prompts"),
        (encode_request(["brightness"], images[:, :, :16], prompts, metadata)[0], kind, 422, "16x32"),
        (encode_request(["brightness"], images[:, :1], prompts, metadata)[0], kind, 400, "[B, 3, H, W]"),
        (json.dumps({"rewards": ["brightness"], "prompts": ["a"], "images_png": ["%%%"]}).encode(), "application/json",
         400, "not base64"),
    ]
    for data, content_type, status, message in cases:
        with pytest.raises(RequestError) as caught:
            request(url, data=data, headers={**headers, "Content-Type": content_type}, timeout=10)
        assert caught.value.status == status and message in str(caught.value), (status, str(caught.value))
    assert request(url, data=body, headers={**headers, "Content-Type": kind}, timeout=10).status == 200


def test_a_missing_or_wrong_token_gets_401(server):
    images, prompts, metadata = toy_batch(2)
    body, kind = encode_request(["brightness"], images, prompts, metadata)
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
        for path, data in (("/v1/score", body), ("/v1/metadata", None)):
            with pytest.raises(RequestError) as caught:
                request(server.url + path, data=data, headers={**headers, "Content-Type": kind}, timeout=10)
            assert caught.value.status == 401 and "bearer token" in str(caught.value)


def test_a_slow_server_triggers_the_timeout_and_nan(server, caplog):
    images, prompts, metadata = toy_batch(2)
    slow = [{**m, "sleep": 3} for m in metadata]
    client = remote(server, "sleepy", timeout=0.5, retries=1, backoff=0.05)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="flowalign.remote.client"):
        scores = client(images, prompts, slow)
    assert torch.isnan(scores).all() and client.failed == 2
    assert time.monotonic() - start < 2.5  # two attempts of 0.5 s, not the server's 3 s
    assert "timed out" in caplog.text and "after 2 attempts" in caplog.text


def test_a_server_restart_is_bridged_by_retries_and_shutdown_finishes_requests_in_flight(tmp_path):
    first = Server(tmp_path, name="first")
    images, prompts, metadata = toy_batch(4)
    expected = build_reward("brightness")(images, prompts, metadata)
    client = remote(first, "brightness", retries=12, backoff=0.25, backoff_max=2.0, timeout=10,
                    breaker_failures=0)
    assert torch.equal(client(images, prompts, metadata), expected)

    # graceful shutdown: SIGTERM while a 1.5 s request is in flight; it is answered, then the server exits 0
    slow = remote(first, "sleepy", retries=0, timeout=20)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(slow, images, prompts, [{**m, "sleep": 1.5} for m in metadata])
        time.sleep(0.5)
        assert first.stop() == 0
        assert torch.equal(pending.result(timeout=30), expected)

    # a restart on the same port while the client retries
    box = {}
    starter = threading.Thread(target=lambda: box.setdefault("server", Server(tmp_path, port=first.port,
                                                                              name="second")))
    starter.start()
    try:
        assert torch.equal(client(images, prompts, metadata), expected)  # retried until the new server answered
        assert client.failed == 0
    finally:
        starter.join(150)
        box["server"].stop()


def test_the_circuit_breaker_opens_after_failures_and_lets_one_trial_through():
    now = [0.0]
    breaker = CircuitBreaker(failures=2, reset_after=10.0, clock=lambda: now[0])
    calls = []

    def failing():
        calls.append(1)
        raise TransientError("down")

    retrying = Retrying(retries=1, backoff=0.0, breaker=breaker, sleep=lambda s: None)
    for _ in range(2):
        with pytest.raises(TransientError, match="after 2 attempts"):
            retrying(failing)
    assert breaker.state == "open" and len(calls) == 4
    with pytest.raises(TransientError, match="circuit open"):
        retrying(failing)
    assert len(calls) == 4  # not sent
    now[0] = 10.0
    assert breaker.state == "half-open"
    assert retrying(lambda: "up") == "up" and breaker.state == "closed"
    assert [retrying.delay(n) for n in (1, 2, 3)] == [0.0, 0.0, 0.0]
    assert [Retrying(backoff=0.5, backoff_max=1.5).delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 1.5, 1.5]


def test_wire_round_trip_keeps_the_tensor_exactly():
    images = torch.rand(3, 3, 8, 8, dtype=torch.float64)
    body, kind = encode_request(["a", "b"], images, ["x", "y", "z"], [{"k": 1}, {}, {}], group_ids=[0, 0, 1])
    parsed = decode_request(body, kind)
    assert torch.equal(parsed.images, images) and parsed.images.dtype == torch.float64
    assert parsed.rewards == ["a", "b"] and parsed.metadata[0] == {"k": 1} and parsed.group_ids == [0, 0, 1]


# ------------------------------------------------------------------------------------------ bad input at start-up
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def test_bad_remote_settings_fail_before_any_model_loads(server, tmp_path):
    def train(kwargs, **extra):
        settings = {"url": server.url, "reward": "toy_geneval", "token_file": str(server.token_file), **kwargs}
        values = {"model.path": str(tmp_path / "no-model"), "reward.rewards": json.dumps(
            [{"name": "remote", "kwargs": settings}]), "train.out_dir": str(tmp_path / "run"), **extra}
        config = load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()])
        with pytest.raises(SetupError) as caught:
            Trainer(config)
        return str(caught.value)

    key = "reward.rewards[0].kwargs"
    closed = f"http://{HOST}:{free_port()}"
    assert f"{key}.url = '{closed}': no reward server answers there" in train({"url": closed})
    assert f"{key}.reward = 'pickscore' is not served" in train({"reward": "pickscore"})
    assert f"{key}.token_file = " in train({"token_file": str(tmp_path / "missing")})
    assert "does not exist" in train({"token_file": str(tmp_path / "missing")})
    (tmp_path / "wrong").write_text("nope")
    assert f"{key}.token_file: the server at {server.url} refused the token" in train(
        {"token_file": str(tmp_path / "wrong")})
    message = train({}, **{"sampling.image_size": 64})
    assert f"{key}.url: the server at {server.url} scores 32x32 images" in message and "samples 64x64" in message
    assert f"{key}.tiemout is not a setting" in train({"tiemout": 3})
    assert f"{key}.allow_pickle: true only for a server you run" in train({"protocol": "flow_grpo"})
    # the size check reads the model's default from its files when the run does not set one
    with pytest.raises(ValueError, match="samples 64x64"):
        check_reward_run("remote", {"url": server.url, "token_file": str(server.token_file), "reward": "brightness"},
                         key="k", model=str(REPO / "assets/toy-sd3"), image_size=64)
    check_reward_run("remote", {"url": server.url, "token_file": str(server.token_file), "reward": "brightness"},
                     key="k", model=str(REPO / "assets/toy-sd3"), image_size=None)  # 32 px: fits


def test_serve_reward_refuses_bad_configs_naming_the_setting(tmp_path):
    from flowalign.cli import parse_command
    from flowalign.config import ConfigError
    from flowalign.remote.server import serve

    for item, message in (("rewards=[{name: nope}]", "rewards[0].name = 'nope' is not a registered reward"),
                          ("rewards=[{name: shell_lcc}]", "scores the model's latents"),
                          ("rewards=[{name: remote}]", "not a client of another server"),
                          ("batch_size=0", "batch_size must be >= 1")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_command(["serve-reward", item])
    _, config = parse_command(["serve-reward", f"token_file={tmp_path / 'missing'}", "port=0"])
    with pytest.raises(SetupError, match=r"token_file = '.*missing' does not exist"):
        serve(config)  # before any reward is built or a port is opened


# ------------------------------------------------------------------------------------------ flow_grpo's protocol
class ThreadServer:
    """An aiohttp test server on 127.0.0.1 in a thread of this process (``handler(request) -> response``)."""

    def __init__(self, routes):
        from aiohttp import web

        self.ready, self.loop = threading.Event(), asyncio.new_event_loop()
        app = web.Application()
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        self.runner = web.AppRunner(app)

        async def start():
            await self.runner.setup()
            site = web.TCPSite(self.runner, HOST, 0)
            await site.start()
            self.port = self.runner.addresses[0][1]
            self.ready.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(start()), self.loop.run_forever()),
                                       daemon=True)
        self.thread.start()
        assert self.ready.wait(30)
        self.url = f"http://{HOST}:{self.port}"

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture
def flow_grpo_server(tmp_path):
    from aiohttp import web
    from PIL import Image

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    async def geneval(request):  # the shape of flow_grpo's GenEval server: JPEGs and meta_datas in, scores out
        data = pickle.loads(await request.read())  # the test's own server, reading the test's own request
        sizes = [Image.open(io.BytesIO(jpeg)).size for jpeg in data["images"]]
        scores = [float(i) / 10 for i, _ in enumerate(sizes)]
        return web.Response(body=pickle.dumps({"scores": np.asarray(scores), "rewards": scores,
                                               "strict_rewards": scores}))

    async def evil(request):
        return web.Response(body=pickle.dumps({"scores": [Evil()]}))

    running = ThreadServer([("POST", "/", geneval), ("POST", "/evil", evil)])
    yield running, marker
    running.stop()


def test_the_flow_grpo_protocol_needs_its_opt_in_and_refuses_code(flow_grpo_server):
    running, marker = flow_grpo_server
    images, prompts, metadata = toy_batch(3)
    with pytest.raises(ValueError, match="allow_pickle: true only for a server you run"):
        build_reward("remote", url=running.url + "/", protocol="flow_grpo")
    client = build_reward("remote", url=running.url + "/", protocol="flow_grpo", allow_pickle=True)
    assert client(images, prompts, metadata).tolist() == pytest.approx([0.0, 0.1, 0.2])
    evil = build_reward("remote", url=running.url + "/evil", protocol="flow_grpo", allow_pickle=True, retries=0)
    assert torch.isnan(evil(images, prompts, metadata)).all()
    assert not marker.exists()  # os.system was refused by the restricted unpickler


# ------------------------------------------------------------------------------------------ the VLM judge
@pytest.fixture
def judge_server():
    """Chat completions with deterministic answers, chosen by a word of the prompt: ``bright`` answers the image's
    brightness as ``Score: N`` (1..10, read from the PNG it received), ``garbage`` an unparseable sentence,
    ``constant`` always ``Score: 7``."""
    from aiohttp import web
    from PIL import Image

    seen = []

    async def chat(request):
        body = await request.json()
        content = body["messages"][-1]["content"]
        url = next(part["image_url"]["url"] for part in content if part["type"] == "image_url")
        text = next(part["text"] for part in content if part["type"] == "text")
        assert url.startswith("data:image/png;base64,")
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
        seen.append({"model": body["model"], "text": text, "size": image.shape, "auth": request.headers.get(
            "Authorization")})
        if "bright" in text:
            answer = f"Score: {1 + round(9 * float(image.mean()) / 255)}"
        elif "garbage" in text:
            answer = "It is a lovely picture, maybe an eight?"
        else:
            answer = "Score: 7"
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]})

    running = ThreadServer([("POST", "/v1/chat/completions", chat)])
    running.seen = seen
    yield running
    running.stop()


def test_vlm_judge_parses_strictly_counts_invalid_and_warns_on_constants(judge_server, tmp_path, caplog):
    key = tmp_path / "key"
    key.write_text("sk-test\n")
    judge = build_reward("vlm_judge", url=judge_server.url + "/v1", model="judge-7b", api_key_file=str(key),
                         log_every=2, concurrency=4)
    levels = torch.tensor([0.0, 0.5, 1.0, 0.25])
    images = levels[:, None, None, None].expand(4, 3, 32, 32).clone()
    with caplog.at_level(logging.INFO, logger="flowalign.remote.judge"):
        scores = judge(images, ["bright a", "bright b", "garbage c", "constant d"], [{}] * 4)
    expected = [(1 + round(9 * round(float(v) * 255) / 255) - 1) / 9 for v in levels[:2]]
    assert scores[:2].tolist() == pytest.approx(expected) and math.isnan(scores[2]) and scores[3] == pytest.approx(
        6 / 9)
    assert judge.unparsed == 1 and "1 of 4 answers do not match the pattern" in caplog.text
    assert "lovely picture" in caplog.text  # the unparseable answer is logged
    assert caplog.text.count("answer 1 for") + caplog.text.count("answer 3 for") == 2  # every 2nd answer logged
    assert all(s["model"] == "judge-7b" and s["auth"] == "Bearer sk-test" and s["size"] == (32, 32, 3)
               for s in judge_server.seen)
    assert "Prompt: \"bright a\"" in judge_server.seen[0]["text"] or any(
        "bright a" in s["text"] for s in judge_server.seen)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flowalign.remote.judge"):
        constant = judge(images, ["constant"] * 4, [{}] * 4)
    assert constant.tolist() == pytest.approx([6 / 9] * 4)
    assert "gave all 4 images of this batch the same score" in caplog.text and "flow_grpo issue #18" in caplog.text

    yes_no = build_reward("vlm_judge", url=judge_server.url + "/v1", model="m", template="Is it {prompt}? {tag}",
                          pattern=r"score:\s*(\d+)", low=0, high=10, normalize=False)
    assert yes_no(images[:1], ["constant x"], [{"tag": "single_object"}]).tolist() == [7.0]
    assert judge_server.seen[-1]["text"] == "Is it constant x? single_object"


def test_vlm_judge_bad_settings_fail_before_anything_loads(judge_server, tmp_path):
    key = "reward.rewards[0].kwargs"

    def check(**kwargs):
        with pytest.raises(ValueError) as caught:
            check_reward_run("vlm_judge", {"url": judge_server.url + "/v1", "model": "m", **kwargs}, key=key,
                             model=None, image_size=None)
        return str(caught.value)

    assert f"{key}.pattern is required" in check(template="Rate {prompt}")
    assert f"{key}.pattern = '(' is not a regular expression" in check(pattern="(")
    assert f"{key}.pattern = 'score' has no group" in check(pattern="score")
    assert f"{key}.api_key_file = " in check(api_key_file=str(tmp_path / "missing"))
    assert f"{key}.url = 'http://{HOST}:" in check(url=f"http://{HOST}:{free_port()}/v1")
    assert f"{key}.template = 'no placeholder' is neither" in check(template="no placeholder")
    check_reward_run("vlm_judge", {"url": judge_server.url + "/v1", "model": "m"}, key=key, model=None,
                     image_size=None)  # reachable (a 404 on /models still answers)


# ------------------------------------------------------------------------------------------ training with a remote reward
def toy_trainer(out: Path, entry: dict, **extra) -> Trainer:
    """The toy world's model and reward, cut to 2 prompts x 4 images, 4 steps, chunks of 4."""
    values = {"model.path": str(REPO / "assets/toy-sd3"), "reward.rewards": json.dumps([entry]),
              "data.prompts_per_iteration": 2, "data.group_size": 4, "sampling.num_steps": 4,
              "sampling.batch_size": 4, "sampling.window_size": "null", "sampling.window_start": "fixed",
              "sampling.window_last": "null", "collapse.held_out": "toy_geneval",
              "collapse.held_out_kwargs": "{partial_credit: false}",  # the same measurement whatever the reward's name "train.iterations": 5, "train.tracker": "none", "train.eval_at_end": "false",
              "train.sample_every": 0, "train.out_dir": str(out), **extra}
    return Trainer(load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()]))


def run_steps(trainer: Trainer, count: int) -> list[dict]:
    return [{k.replace("rewards/remote/", "rewards/toy_geneval/"): v for k, v in trainer.step().items()
             if not k.startswith("time/")} for _ in range(count)]


def weights(trainer: Trainer) -> dict:
    return {name: value.detach().clone() for name, value in trainer.trainable_state().items()}


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(
        x[k] == y[k] or (math.isnan(x[k]) and math.isnan(y[k])) for k in x) for x, y in zip(a, b))


TOY_GENEVAL = {"name": "toy_geneval", "kwargs": {"partial_credit": True}}


def test_a_toy_run_scored_remotely_equals_the_in_process_run_with_and_without_overlap(server, tmp_path):
    served = {"name": "remote", "kwargs": {"url": server.url, "reward": "toy_geneval",
                                           "token_file": str(server.token_file)}}
    local = toy_trainer(tmp_path / "local", TOY_GENEVAL)
    expected, expected_weights = run_steps(local, 5), weights(local)
    assert any(m["reward_std"] > 0 for m in expected) and not any(m["skipped"] for m in expected)
    for name, entry, extra in (("remote", served, {}), ("remote-overlap", served, {"reward.overlap": "true"}),
                               ("local-overlap", TOY_GENEVAL, {"reward.overlap": "true"})):
        trainer = toy_trainer(tmp_path / name, entry, **extra)
        assert same(run_steps(trainer, 5), expected), name
        assert all(torch.equal(value, expected_weights[key]) for key, value in weights(trainer).items()), name


def test_a_killed_server_makes_its_iteration_invalid_and_the_run_goes_on(tmp_path):
    first = Server(tmp_path, name="train-server")
    served = {"name": "remote", "kwargs": {"url": first.url, "reward": "toy_geneval", "timeout": 5, "retries": 1,
                                           "backoff": 0.05, "breaker_failures": 0,
                                           "token_file": str(first.token_file)}}
    trainer = toy_trainer(tmp_path / "run", served)
    stopper = toy_trainer(tmp_path / "strict", served, **{"reward.max_invalid_fraction": 0.5})
    second = None
    try:
        history = run_steps(trainer, 2)
        first.stop(signal.SIGKILL)
        before = weights(trainer)
        with pytest.warns(UserWarning, match="every group has zero reward variance; skipping the update"):
            (down,) = run_steps(trainer, 1)
        assert down["reward_invalid"] == 8 and down["skipped"] == 1.0 and math.isnan(down["reward"])
        assert all(torch.equal(value, before[key]) for key, value in weights(trainer).items())
        with pytest.raises(RuntimeError, match=r"8 of the iteration's 8 samples \(100%\) have an invalid reward .* "
                                               r"more than reward.max_invalid_fraction = 0.5"):
            stopper.step()
        second = Server(tmp_path, port=first.port, name="train-server-2")
        history += [down, *run_steps(trainer, 2)]
    finally:
        if second is not None:
            second.stop()
    assert [m["reward_invalid"] for m in history] == [0, 0, 8, 0, 0]
    assert [m["skipped"] for m in history][3:] == [0.0, 0.0] and len(history) == 5


def test_more_invalid_than_skip_invalid_fraction_skips_the_update(tmp_path):
    from flowalign.rewards import REWARDS, register_reward

    class QuarterNaN:
        name = "quarter_nan"

        def __call__(self, images, prompts, metadata):
            scores = images.flatten(1).mean(1)
            scores[::4] = float("nan")
            return scores

    register_reward("quarter_nan", QuarterNaN, overwrite=True)
    try:
        masked = toy_trainer(tmp_path / "masked", {"name": "quarter_nan"})
        (kept,) = run_steps(masked, 1)
        skipping = toy_trainer(tmp_path / "skip", {"name": "quarter_nan"}, **{"reward.skip_invalid_fraction": 0.2})
        with pytest.warns(UserWarning, match=r"25% of the samples have an invalid reward, more than "
                                             r"reward.skip_invalid_fraction = 0.2; skipping the update"):
            (skipped,) = run_steps(skipping, 1)
    finally:
        REWARDS.unregister("quarter_nan")
    assert kept["reward_invalid"] == skipped["reward_invalid"] == 2
    assert kept["skipped"] == 0.0 and skipped["skipped"] == 1.0


def test_overlap_scores_each_chunk_on_the_worker_thread(tmp_path):
    from flowalign.rewards import REWARDS, register_reward

    calls = []

    class Recorder:
        name = "recorder"

        def __call__(self, images, prompts, metadata):
            calls.append((threading.current_thread().name, len(prompts)))
            return images.flatten(1).mean(1)

    register_reward("recorder", Recorder, overwrite=True)
    try:
        run_steps(toy_trainer(tmp_path / "seq", {"name": "recorder"}), 1)
        sequential, calls[:] = list(calls), []
        run_steps(toy_trainer(tmp_path / "overlap", {"name": "recorder"}, **{"reward.overlap": "true"}), 1)
    finally:
        REWARDS.unregister("recorder")
    assert sequential == [("MainThread", 8)]
    assert [size for _, size in calls] == [4, 4] and all(name.startswith("chunk-scoring") for name, _ in calls)


# ------------------------------------------------------------------------------------------ hostile input (issue 41)
def post(server, body: bytes, content_type: str, headers: dict | None = None):
    """``(status, answer)`` of a score request (an error status does not raise)."""
    try:
        answer = request(f"{server.url}/v1/score", data=body, headers={**auth(), "Content-Type": content_type,
                                                                       **(headers or {})}, timeout=30)
        return answer.status, answer.json()
    except RequestError as error:
        return error.status, str(error)
    except TransientError as error:
        return error.status, str(error)


def test_a_bad_request_never_fails_a_concurrent_good_one(server):
    """Issue 41 (6, High): requests merged into one batch fail one by one. ``toy_geneval`` checks each request's
    metadata before batching (422 for the bad one); ``sleepy`` has no such check, and fails on a bad ``sleep`` while
    scoring: the merged batch is scored again request by request, so only the bad one fails (500)."""
    images, prompts, metadata = toy_batch(2)
    untagged = [{k: v for k, v in m.items() if k != "tag"} for m in metadata]
    body = lambda rewards, meta: encode_request(rewards, images, prompts, meta)[0]  # noqa: E731
    kind = "application/x-safetensors"
    expected_toy = build_reward("toy_geneval", partial_credit=True)(images, prompts, metadata).tolist()
    expected_sleepy = images.flatten(1).mean(1).tolist()
    blocker = body(["sleepy"], [{"sleep": 0.3}] * 2)  # holds the scoring thread, so the next requests queue and merge
    with ThreadPoolExecutor(5) as pool:
        for _ in range(20):
            busy = pool.submit(post, server, blocker, kind)
            time.sleep(0.05)
            answers = list(pool.map(lambda data: post(server, data, kind), [
                body(["sleepy"], [{"sleep": 0}] * 2), body(["sleepy"], [{"sleep": "soon"}] * 2),
                body(["toy_geneval"], metadata), body(["toy_geneval"], untagged)]))
            assert busy.result()[0] == 200
            (good_sleepy, bad_sleepy, good_toy, bad_toy) = answers
            assert good_sleepy == (200, {"protocol": 1, "scores": {"sleepy": pytest.approx(expected_sleepy)}})
            assert good_toy == (200, {"protocol": 1, "scores": {"toy_geneval": expected_toy}})
            assert bad_sleepy[0] == 500 and "scoring failed: the reward raised RuntimeError" in bad_sleepy[1]
            assert bad_toy[0] == 422 and "metadata[0]: field 'tag': missing" in bad_toy[1]


def test_malformed_safetensors_metadata_gets_a_400_not_a_500(server):
    """Issue 41 (1d): a ``__metadata__`` that is a string, or a ``flowalign`` value that is not a string."""
    import struct

    def file(header: dict) -> bytes:
        size = 3 * 32 * 32 * 4
        text = json.dumps({"images": {"dtype": "F32", "shape": [1, 3, 32, 32], "data_offsets": [0, size]},
                           **header}).encode()
        return struct.pack("<Q", len(text)) + text + bytes(size)

    request_json = json.dumps({"rewards": ["brightness"], "prompts": ["x"], "metadata": [{}]})
    for header, message in (({"__metadata__": "a string"}, "__metadata__ must be an object"),
                            ({"__metadata__": {"flowalign": 7}}, "no 'flowalign' request (a JSON string)"),
                            ({"__metadata__": {"flowalign": ["x"]}}, "no 'flowalign' request (a JSON string)"),
                            ({"__metadata__": {"flowalign": "[" * 100_000}}, "is not JSON")):
        status, message_got = post(server, file(header), "application/x-safetensors")
        assert status == 400 and message in message_got, (header, status, message_got)
    assert post(server, file({"__metadata__": {"flowalign": request_json}}), "application/x-safetensors")[0] == 200


def test_health_shows_request_counts_only_with_the_token(server):
    assert request(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    assert request(f"{server.url}/health", headers={"Authorization": "Bearer nope"}, timeout=10).json() == {
        "status": "ok"}
    assert set(request(f"{server.url}/health", headers=auth(), timeout=10).json()["served"]) == {
        "requests", "images", "batches"}


def test_the_jobs_of_a_request_whose_client_went_away_are_not_scored(server):
    """Issue 41 (1d): 24 images of ``sleepy`` (3 jobs of 8, 0.6 s each); the client gives up after 0.3 s. The job in
    flight finishes; the two still queued are dropped, so the server scores at most 1 batch, not 3."""
    import http.client

    images, prompts, metadata = toy_batch(24)
    body, kind = encode_request(["sleepy"], images, prompts, [{"sleep": 0.6}] * 24)

    def batches() -> int:
        return request(f"{server.url}/health", headers=auth(), timeout=10).json()["served"]["batches"]

    before = batches()
    connection = http.client.HTTPConnection(HOST, server.port, timeout=0.3)
    with pytest.raises(TimeoutError):
        connection.request("POST", "/v1/score", body=body, headers={**auth(), "Content-Type": kind})
        connection.getresponse()
    connection.close()
    time.sleep(2.5)  # long enough for all three jobs, had they been kept
    assert batches() - before <= 1  # at most the job in flight when the client left (3 before the fix)


class CountingServer:
    """A ``ThreadServer`` that answers ``/v1/metadata`` like a flowalign server and ``/v1/score`` with ``answer``,
    counting the score requests it receives."""

    def __init__(self, answer):
        from aiohttp import web

        self.hits = 0

        async def metadata(request):
            return web.json_response({"protocol": 1, "rewards": {"brightness": {"version": "x"}}, "image_size": None,
                                      "batch_size": 8})

        async def score(request):
            self.hits += 1
            await request.read()
            return answer(web)

        self.running = ThreadServer([("GET", "/v1/metadata", metadata), ("POST", "/v1/score", score)])
        self.url = self.running.url

    def stop(self):
        self.running.stop()


@pytest.mark.parametrize("name, answer", [
    ("html", lambda web: web.Response(text="<html><body>502 Bad Gateway</body></html>", content_type="text/html")),
    ("wrong count", lambda web: web.json_response({"protocol": 1, "scores": {"brightness": [0.5]}})),
    ("truncated", lambda web: web.Response(body=b'{"protocol": 1, "scores": {"bright',
                                           content_type="application/json")),
])
def test_a_200_that_is_not_the_scores_is_retried_and_gives_nan(name, answer, caplog):
    """Issue 41 (6, High): a 200 whose body is HTML, or holds the wrong number of scores, is a transient failure:
    retried, then NaN (invalid samples), and counted by the circuit breaker (here: open after 2 failed requests)."""
    fake = CountingServer(answer)
    try:
        client = build_reward("remote", url=fake.url, retries=1, backoff=0.01, breaker_failures=2,
                              breaker_reset=60)
        images = torch.rand(2, 3, 8, 8)
        with caplog.at_level(logging.WARNING, logger="flowalign.remote.client"):
            for _ in range(3):
                assert torch.isnan(client(images, ["a", "b"], [{}, {}])).all()
    finally:
        fake.stop()
    assert fake.hits == 4  # 2 requests of 2 attempts; the third found the circuit open and was not sent
    assert client.failed == 6 and "is not the 2 scores asked for" in caplog.text and "circuit open" in caplog.text


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 415, 422])
def test_a_4xx_is_never_retried_and_stops_with_one_line_naming_url_and_status(status):
    """Issue 41 (1d, 6): a permanent answer in the middle of a run raises ``ServerRefused`` (a ``RunStopped``) at
    the first attempt, with one line naming the URL and the status."""
    from flowalign.errors import RunStopped

    fake = CountingServer(lambda web: web.json_response({"error": "nope:\n  not\there"}, status=status))
    try:
        client = build_reward("remote", url=fake.url, retries=3, backoff=5)
        with pytest.raises(RunStopped) as caught:
            client(torch.rand(2, 3, 8, 8), ["a", "b"], [{}, {}])
    finally:
        fake.stop()
    assert fake.hits == 1
    message = str(caught.value)
    assert "\n" not in message and f"{fake.url}/v1/score answered HTTP {status} (nope: not here)" in message


def test_a_request_the_reward_refuses_is_a_422_that_the_client_does_not_retry(server):
    """Issue 41 (1d): toy_geneval without the GenEval ``tag`` is the client's mistake: 422 naming the field, and the
    client stops at once (a ``RunStopped``), never retrying it as a server fault."""
    from flowalign.errors import RunStopped

    images, prompts, metadata = toy_batch(2)
    untagged = [{k: v for k, v in m.items() if k != "tag"} for m in metadata]
    client = remote(server, "toy_geneval", retries=3, backoff=5)
    with pytest.raises(RunStopped, match=r"answered HTTP 422 \(refused by the reward: metadata\[0\]: field 'tag': "
                                         r"missing"):
        client(images, prompts, untagged)
