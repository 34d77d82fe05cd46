"""Videos out of process: the reward server's video payload (safetensors and PNG frames) with its limits checked
before any frame is decoded, hostile video requests, the remote reward scoring videos, and the VLM judge over a
video's sampled frames. Every server is real: aiohttp on 127.0.0.1 on a thread of this process."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from flowalign.remote.transport import RequestError, request
from flowalign.remote.wire import Limits, WireError, decode_request, encode_request
from flowalign.rewards import build_reward

HOST = "127.0.0.1"
ST, JSON = "application/x-safetensors", "application/json"


def clip(levels, size=8):
    """``[B, F, 3, size, size]``: frame j of video b is the constant ``levels[b][j]``."""
    return torch.tensor(levels, dtype=torch.float32)[:, :, None, None, None].expand(-1, -1, 3, size, size).clone()


class ThreadedServer:
    """``flowalign.remote.server`` with ``config`` on a thread of this process, stopped through its stop event."""

    def __init__(self, tmp_path: Path, **settings):
        from flowalign.remote.server import RewardServer, ServeRewardConfig, ServedReward, _serve

        rewards = settings.pop("rewards")
        config = ServeRewardConfig(rewards=[ServedReward(**spec) for spec in rewards], host=HOST, port=0,
                                   port_file=str(tmp_path / "port"), batch_size=8, threads=1, shutdown_timeout=5,
                                   **settings)
        config.validate()
        self.server = RewardServer.build(config)
        self.loop, self.ready, self.stop_event = asyncio.new_event_loop(), threading.Event(), None

        async def main():
            self.stop_event = asyncio.Event()
            await _serve(self.server, config, self.ready, self.stop_event)

        self.thread = threading.Thread(target=lambda: self.loop.run_until_complete(main()), daemon=True)
        self.thread.start()
        assert self.ready.wait(60)
        self.url = f"http://{HOST}:{int((tmp_path / 'port').read_text())}"

    def post(self, body: bytes, kind: str) -> tuple[int, dict]:
        try:
            answer = request(f"{self.url}/v1/score", data=body, headers={"Content-Type": kind}, timeout=60)
            return answer.status, json.loads(answer.body)
        except RequestError as error:
            return error.status, {"error": str(error)}

    def stop(self):
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def video_server(tmp_path_factory):
    running = ThreadedServer(tmp_path_factory.mktemp("video-server"), max_frames=6, max_pixels=64 * 64,
                             max_request_pixels=4 * 6 * 16 * 16,
                             rewards=[{"name": "brightness", "frames": {"aggregate": "min"}},
                                      {"name": "temporal_consistency", "kwargs": {"embedding_kwargs": {"grid": 1}}},
                                      {"name": "toy_geneval"}])
    yield running
    running.stop()


# ------------------------------------------------------------------------------------------- the wire format
def test_a_video_request_round_trips_in_both_encodings():
    videos = torch.rand(2, 3, 3, 8, 6)
    body, kind = encode_request(["brightness"], videos, ["a", "b"], [{}, {"k": 1}])
    decoded = decode_request(body, kind)
    assert decoded.is_video and torch.equal(decoded.images, videos) and decoded.metadata == [{}, {"k": 1}]
    body, kind = encode_request(["brightness"], videos, ["a", "b"], [{}, {}], encoding="png")
    assert kind == JSON and len(json.loads(body)["videos_png"][1]) == 3
    decoded = decode_request(body, kind)
    assert decoded.images.shape == (2, 3, 3, 8, 6)
    assert torch.equal(decoded.images, (videos * 255).round() / 255)


def png(height: int, width: int, level: int = 128) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), level, dtype=np.uint8)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def json_videos(videos: list[list[str]]) -> bytes:
    return json.dumps({"rewards": ["brightness"], "prompts": ["x"] * len(videos), "metadata": [{}] * len(videos),
                       "videos_png": videos}).encode()


def st_videos(shape: list[int], data: bytes | None = None, dtype: str = "U8") -> bytes:
    """A safetensors body whose header declares ``videos`` of ``shape`` and holds ``data`` (default: all of it)."""
    size = int(np.prod(shape)) * {"U8": 1, "F32": 4}[dtype]
    header = {"__metadata__": {"flowalign": json.dumps({"rewards": ["brightness"], "prompts": ["x"] * shape[0]})},
              "videos": {"dtype": dtype, "shape": shape, "data_offsets": [0, size]}}
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + (bytes(size) if data is None else data)


@pytest.mark.parametrize("body, kind, status, message", [
    (st_videos([1, 7, 3, 8, 8]), ST, 413, "video 0 has 7 frames, more than the server's max_frames 6"),
    (st_videos([1, 2, 3, 65, 64]), ST, 413, "more than the server's max_pixels"),
    (st_videos([5, 6, 3, 16, 16]), ST, 413, "more than the server's max_request_pixels"),
    (st_videos([1, 0, 3, 8, 8]), ST, 400, "video 0 holds no frames"),
    (st_videos([1, 2, 3, 8, 8], data=bytes(100)), ST, 400, "the body is truncated"),
    (st_videos([1, 2, 4, 8, 8]), ST, 400, r"must be \[B, F, 3, H, W\]"),
    (json_videos([[png(8, 8)] * 7]), JSON, 413, "video 0 has 7 frames"),
    (json_videos([[png(8, 8), png(8, 8), png(16, 8)]]), JSON, 400, "video 0 frame 2 is 16x8, but frame 0 of video 0 "
                                                                   "is 8x8"),
    (json_videos([[png(8, 8)] * 2, [png(8, 8)] * 3]), JSON, 400, "share one frame count"),
    (json_videos([[png(8, 8), png(8, 8)[:40]]]), JSON, 400, "is not (base64|a readable PNG)"),
    (json_videos([[png(65, 64)]]), JSON, 413, "max_pixels"),
])
def test_hostile_video_requests_are_refused_before_any_frame_is_decoded(body, kind, status, message, monkeypatch):
    import flowalign.remote.wire as wire

    def no_decoding(*args, **kwargs):
        raise AssertionError("a frame was decoded before the limits were checked")

    limits = Limits(max_pixels=64 * 64, max_request_pixels=4 * 6 * 16 * 16, max_frames=6)
    if status == 413 or "frames" in message:
        monkeypatch.setattr(wire, "_decode_png", no_decoding)
        monkeypatch.setattr("safetensors.torch.load", no_decoding)
    with pytest.raises(WireError, match=message) as error:
        decode_request(body, kind, limits=limits)
    assert error.value.status == status


# ------------------------------------------------------------------------------------------- the server and client
def test_the_server_scores_videos_with_video_rewards_and_image_rewards_over_frames(video_server):
    videos = clip([[0.2, 0.6, 0.4], [0.9, 0.3, 0.5]])
    remote = build_reward("remote", url=video_server.url, reward="brightness")
    assert remote(videos, ["a", "b"], [{}, {}]).tolist() == pytest.approx([0.2, 0.3])  # min over frames
    # grey frames under the pooled pixel embedding (level - 0.5): the sign of the level's offset from 0.5 decides
    # each cosine, +1 or -1: 0.2, 0.6, 0.4 flip twice (-1); 0.9, 0.7, 0.1 keep once and flip once (0)
    remote = build_reward("remote", url=video_server.url, reward="temporal_consistency", encoding="png")
    videos = clip([[0.2, 0.6, 0.4], [0.9, 0.7, 0.1]])
    assert remote(videos, ["a", "b"], [{}, {}]).tolist() == pytest.approx([-1.0, 0.0], abs=1e-6)
    meta = json.loads(request(f"{video_server.url}/v1/metadata", timeout=30).body)
    assert {name: info["modality"] for name, info in meta["rewards"].items()} == {
        "brightness": "video", "temporal_consistency": "video", "toy_geneval": "image"}


def test_the_server_refuses_videos_for_an_image_reward_and_images_for_a_video_reward(video_server):
    body, kind = encode_request(["toy_geneval"], clip([[0.1, 0.2]]), ["a"], [{}])
    status, answer = video_server.post(body, kind)
    assert status == 422 and "reward 'toy_geneval' scores images and this request holds videos" in answer["error"]
    assert "frames: {aggregate: mean}" in answer["error"]
    body, kind = encode_request(["temporal_consistency"], torch.zeros(1, 3, 8, 8), ["a"], [{}])
    status, answer = video_server.post(body, kind)
    assert status == 422 and "scores videos" in answer["error"]
    status, answer = video_server.post(st_videos([1, 9, 3, 8, 8]), ST)
    assert status == 413 and "max_frames 6" in answer["error"]


def test_serving_frames_on_a_video_reward_is_refused_naming_the_setting(tmp_path):
    from flowalign.config import ConfigError
    from flowalign.remote.server import ServeRewardConfig, ServedReward

    config = ServeRewardConfig(rewards=[ServedReward("brightness"), ServedReward("motion", frames={})])
    with pytest.raises(ConfigError, match=r"rewards\[1\].frames is set, but 'motion' is a video reward"):
        config.validate()


# ------------------------------------------------------------------------------------------- the VLM judge
@pytest.fixture
def frame_judge():
    """Chat completions that read every image part in order and answer ``Score: N`` with N = 1 + the number of
    frames brighter than the one before (so the order and count of the frames decide the score)."""
    from aiohttp import web
    from PIL import Image

    from test_remote_rewards import ThreadServer

    seen = []

    async def chat(request):
        content = (await request.json())["messages"][-1]["content"]
        levels = [float(np.asarray(Image.open(io.BytesIO(base64.b64decode(part["image_url"]["url"].split(",")[1])))
                                   .convert("RGB")).mean()) for part in content if part["type"] == "image_url"]
        seen.append({"levels": levels, "text": next(p["text"] for p in content if p["type"] == "text")})
        rising = sum(b > a for a, b in zip(levels, levels[1:]))
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": f"Score: {1 + rising}"}}]})

    running = ThreadServer([("POST", "/v1/chat/completions", chat)])
    running.seen = seen
    yield running
    running.stop()


def test_the_vlm_judge_sends_a_videos_sampled_frames_in_order(frame_judge):
    judge = build_reward("vlm_judge", url=frame_judge.url + "/v1", model="judge", template="video_alignment",
                         video_frames=3, normalize=False)
    # 5 frames; frames 0, 2, 4 are sent: levels 0.1, 0.5, 0.9 rise twice (score 3); 0.9, 0.5, 0.1 never (score 1)
    videos = clip([[0.1, 0.8, 0.5, 0.0, 0.9], [0.9, 0.0, 0.5, 1.0, 0.1]])
    scores = judge(videos, ["a red circle moving", "b"], [{}, {}])
    assert scores.tolist() == [3.0, 1.0]
    sent = sorted(frame_judge.seen, key=lambda entry: entry["levels"][0])
    assert [[round(v / 255, 2) for v in entry["levels"]] for entry in sent] == [[0.1, 0.5, 0.9], [0.9, 0.5, 0.1]]
    assert "its frames, in order" in sent[0]["text"]
    # an image is still one image part
    assert judge(torch.full((1, 3, 8, 8), 0.5), ["c"], [{}]).tolist() == [1.0]
    assert len(frame_judge.seen[-1]["levels"]) == 1
    judge.close()
