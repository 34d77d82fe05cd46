"""``flowalign serve-reward CONFIG``: registered rewards served over HTTP (aiohttp), for the ``remote`` reward.

Endpoints (``flowalign.remote.wire`` has the body formats):

* ``GET /health``: ``{"status": "ok"}``; never needs the token (for load balancers and start-up probes).
* ``GET /v1/metadata``: what the server serves: ``{"protocol", "flowalign_version", "rewards": {name: {"version",
  "class", "kwargs", "groupwise", "score_range"}}, "image_size": [H, W] or null, "batch_size", "encodings"}``.
* ``POST /v1/score``: a score request; the answer holds one float32 score per image and reward.

Batching. Each served reward has a queue and one batcher: it takes the oldest waiting request and adds the next ones
(same image size and dtype, up to ``batch_size`` images in all, waiting at most ``batch_wait_ms`` for more), scores
them in one call of the reward and hands each request its slice. A request of more than ``batch_size`` images is cut
into pieces of at most ``batch_size``. All scoring runs on one worker thread, one call at a time (one model, one
device); the event loop keeps reading, decoding and answering meanwhile. A groupwise reward is called once per
request with that request's ``group_ids`` (requests are never merged for it: its score depends on the group). A
reward scoring latents (``reads_latents``) cannot be served: the server sees images only. Videos. A request may carry
videos ``[B, F, 3, H, W]`` (``flowalign.remote.wire``); a video reward (``modality: video``) takes them, an image reward
only when served with ``frames`` (its frame aggregation, ``flowalign.reward_models.frames``), and any other pairing is
answered 422 naming the reward.

Limits. A request's body is read whole, within ``read_timeout`` seconds (408 beyond), before it takes a slot, so slow
uploads cannot hold the slots; ``max_concurrency`` requests are then decoded and scored at once, up to ``max_queued``
more read or wait for a slot, and beyond that a request is answered 503 (the client backs off and retries). A body
over ``max_request_mb`` is answered 413. Before any image is decoded, its size is read from its header and checked:
at most ``max_pixels`` per image (or video frame), ``max_request_pixels`` per request and ``max_frames`` per video
(413), and ``image_size`` when set (422);
PIL's own decompression-bomb limit is set to ``max_pixels`` as well (``flowalign.remote.wire``). With
``token_file``, every endpoint but ``/health`` needs ``Authorization: Bearer <token>`` (401 otherwise; the token is
compared in constant time), and ``/health`` shows its request counts only to a request that carries the token.

Bad input. Every malformed request gets a 4xx that the client does not retry, never a 5xx: an unreadable body 400,
an unknown reward 404, and a request a reward refuses (``flowalign.errors.RewardInputError``, from the reward's
``check_inputs``, which runs on each request before it is merged into a batch, or from scoring) 422, with the
reward's message. When a merged batch fails, each of its requests is scored again alone, so one client's bad request
never fails another's good one. A reward's own fault is a 500 whose message names no file of the server (the log has
the details). A request whose client went away is cancelled, and its jobs not yet scored are dropped.

Files. A reward that opens files named in its metadata (``reads_files``, e.g. ``source_similarity``) is served only
when ``files_root`` names a directory: every such path (relative to the root, or absolute) must resolve, symlinks and
``..`` followed, to a file under it, and the reward reads the resolved path. Any other path is answered 400 with a
message that names the sample and key, never a server path, and that is the same for a path outside the root and a
missing file inside it (no probing of the server's disk).

Shutdown. SIGTERM or SIGINT stops accepting connections, lets every request in flight finish (at most
``shutdown_timeout`` seconds), and then exits.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flowalign.errors import RewardInputError
from flowalign.remote.wire import (DEFAULT_MAX_FRAMES, DEFAULT_MAX_PIXELS, DEFAULT_MAX_REQUEST_PIXELS, ENCODINGS,
                                   PROTOCOL, Limits,
                                   ScoreRequest, WireError, decode_request, encode_scores)
from flowalign.settings import at_least, check, option

__all__ = ["RewardServer", "ServeRewardConfig", "ServedReward", "serve"]

logger = logging.getLogger(__name__)


@dataclass
class ServedReward:
    """One reward the server serves: a registered name and its constructor's keyword arguments."""

    name: str = option("toy_geneval", "registered reward name (flowalign.rewards.REWARDS)")
    kwargs: dict[str, Any] = option({}, "keyword arguments for the reward's constructor (device, batch_size, ...)")
    frames: dict[str, Any] | None = option(None, "serve an image reward on videos: its frame aggregation, {aggregate: "
                                                 "mean|min|weights, weights, every | count} "
                                                 "(flowalign.reward_models.frames); null = the reward's own input")


@dataclass
class ServeRewardConfig:
    """Settings of ``flowalign serve-reward``."""

    rewards: list[ServedReward] = option([ServedReward()], "rewards to serve, each {name, kwargs, frames}")
    host: str = option("127.0.0.1", "address to listen on; 127.0.0.1 = this machine only (use 0.0.0.0 with a "
                                    "token_file to serve other machines)")
    port: int = option(8765, "port to listen on; 0 = any free port (written to port_file)")
    port_file: str | None = option(None, "write the port the server listens on to this file once it is ready")
    batch_size: int = option(32, "most images scored in one call of a reward (requests are merged up to it)")
    batch_wait_ms: float = option(5.0, "how long a batch waits for more requests before it is scored (ms)")
    max_concurrency: int = option(64, "requests decoded and scored at once")
    max_queued: int = option(1024, "requests waiting for a slot beyond max_concurrency; more are answered 503")
    max_request_mb: float = option(512.0, "largest request body in MiB (413 beyond)")
    max_pixels: int = option(DEFAULT_MAX_PIXELS, "most pixels of one image, read from its header before it is "
                                                 "decoded (413 beyond); also PIL's decompression-bomb limit")
    max_request_pixels: int = option(DEFAULT_MAX_REQUEST_PIXELS, "most pixels of all the images of one request, "
                                                                 "read from their headers (413 beyond)")
    max_frames: int = option(DEFAULT_MAX_FRAMES, "most frames of one video, read from the request before any frame "
                                                 "is decoded (413 beyond)")
    read_timeout: float = option(60.0, "seconds a client may take to send its request body (408 beyond); the body "
                                       "is read before the request takes a slot")
    files_root: str | None = option(None, "the directory a reward that opens files named in its metadata "
                                          "(reads_files, e.g. source_similarity) may read under; such a reward is "
                                          "refused without it, and paths outside it are answered 400")
    image_size: int | None = option(None, "the side of the square images the rewards expect; requests of another "
                                          "size are answered 422, and clients check it at start-up; null = any size")
    token_file: str | None = option(None, "file holding the bearer token every request but /health must carry; "
                                          "null = no token")
    shutdown_timeout: float = option(60.0, "on SIGTERM/SIGINT, how long requests in flight may still take (s)")
    threads: int | None = option(None, "torch intra-op threads of the scoring thread; null = torch's default")

    def validate(self) -> None:
        check(len(self.rewards) > 0, "rewards", "must list at least one reward to serve")
        names = [spec.name for spec in self.rewards]
        check(len(set(names)) == len(names), "rewards", f"names must be unique (they key the answers), got {names}")
        from flowalign.rewards import REWARDS, files_read, reads_latents, reward_class

        for i, spec in enumerate(self.rewards):
            if spec.name not in REWARDS:
                close = REWARDS.closest(spec.name)
                check(False, f"rewards[{i}].name", f"= {spec.name!r} is not a registered reward; known: "
                      f"{', '.join(REWARDS.names())}" + (f"; did you mean {close!r}?" if close else ""))
            check(spec.name not in ("remote", "vlm_judge"), f"rewards[{i}].name",
                  f"= {spec.name!r}: serve the rewards themselves, not a client of another server")
            check(not reads_latents(reward_class(spec.name)), f"rewards[{i}].name",
                  f"= {spec.name!r} scores the model's latents; a reward server sees images only")
            if spec.frames is not None:
                from flowalign.rewards import check_reward_fits

                check_reward_fits(spec.name, spec.frames, "video", at=f"rewards[{i}]")  # an image reward, well formed
            keys = files_read(reward_class(spec.name))
            check(not keys or self.files_root is not None, f"rewards[{i}].name",
                  f"= {spec.name!r} opens the files that a request's metadata names ({', '.join(keys)}): serve it "
                  "only with files_root (--files-root DIR), the directory its files may be read from; every path "
                  "outside it is refused")
        if self.files_root is not None:
            check(Path(self.files_root).expanduser().is_dir(), "files_root",
                  f"= {self.files_root!r} is not a directory")
        check(bool(self.host), "host", "must not be empty")
        check(0 <= self.port <= 65535, "port", f"must be in [0, 65535], got {self.port}")
        at_least("batch_size", self.batch_size, 1)
        at_least("max_concurrency", self.max_concurrency, 1)
        at_least("max_queued", self.max_queued, 0)
        at_least("image_size", self.image_size, 1)
        check(math.isfinite(self.batch_wait_ms) and self.batch_wait_ms >= 0, "batch_wait_ms",
              f"must be >= 0, got {self.batch_wait_ms}")
        check(math.isfinite(self.max_request_mb) and self.max_request_mb > 0, "max_request_mb",
              f"must be > 0, got {self.max_request_mb}")
        check(math.isfinite(self.shutdown_timeout) and self.shutdown_timeout >= 0, "shutdown_timeout",
              f"must be >= 0, got {self.shutdown_timeout}")
        at_least("threads", self.threads, 1)
        at_least("max_pixels", self.max_pixels, 1)
        at_least("max_request_pixels", self.max_request_pixels, 1)
        at_least("max_frames", self.max_frames, 1)
        check(math.isfinite(self.read_timeout) and self.read_timeout > 0, "read_timeout",
              f"must be > 0, got {self.read_timeout}")

    def limits(self) -> Limits:
        """What one request may hold (``flowalign.remote.wire.Limits``)."""
        return Limits(max_pixels=self.max_pixels, max_request_pixels=self.max_request_pixels,
                      image_size=self.image_size, max_frames=self.max_frames)


def read_token(path: str | Path, key: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped); a missing or empty file is a ValueError naming
    ``key``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"{key} = {str(path)!r} does not exist: write the token to that file, or set {key}: null "
                         "for no token")
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{key} = {str(path)!r} is empty: it must hold the bearer token")
    return token


def reward_version(name: str, fn: Any) -> str:
    """A reward's ``version`` attribute, else ``flowalign <version>`` (the code that scores)."""
    import flowalign

    version = getattr(fn, "version", None)
    return str(version) if version is not None else f"flowalign {flowalign.__version__}"


@dataclass
class _Job:
    """A piece of one request for one reward: at most ``batch_size`` images."""

    images: Tensor
    prompts: list[str]
    metadata: list[dict]
    group_ids: list[int] | None
    future: asyncio.Future = field(repr=False)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def key(self) -> tuple:
        return tuple(self.images.shape[1:]), self.images.dtype


class RewardServer:
    """The served rewards, their batchers and the aiohttp application (module docstring). ``rewards`` are
    ``(name, fn)`` pairs already built (``build`` builds them from a config)."""

    def __init__(self, config: ServeRewardConfig, rewards: list[tuple[str, Any]], *, token: str | None = None):
        self.config, self.rewards, self.token = config, dict(rewards), token
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-scoring",
                                           initializer=self._init_thread)
        self.queues: dict[str, asyncio.Queue] = {}
        self.workers: list[asyncio.Task] = []
        self.slots: asyncio.Semaphore | None = None
        self.waiting = 0  # requests reading their body or waiting for a slot
        self.served = {"requests": 0, "images": 0, "batches": 0}
        self.limits = config.limits()
        self.files_root = None if config.files_root is None else Path(config.files_root).expanduser().resolve()

    @classmethod
    def build(cls, config: ServeRewardConfig) -> "RewardServer":
        """Build every reward of ``config`` (its weights load here) and read the token."""
        from flowalign.rewards import build_reward

        token = read_token(config.token_file, "token_file") if config.token_file is not None else None
        from flowalign.reward_models.frames import over_frames

        rewards = [(spec.name, build_reward(spec.name, **spec.kwargs)) for spec in config.rewards]
        rewards = [(name, fn if spec.frames is None else over_frames(fn, spec.frames, f"rewards[{i}].frames"))
                   for i, (spec, (name, fn)) in enumerate(zip(config.rewards, rewards))]
        return cls(config, rewards, token=token)

    def _init_thread(self) -> None:
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)

    # --------------------------------------------------------------------------------------------- metadata
    def metadata(self) -> dict:
        import flowalign
        from flowalign.rewards import is_groupwise, reward_modality, score_range

        kwargs = {spec.name: spec.kwargs for spec in self.config.rewards}
        size = self.config.image_size
        return {
            "server": "flowalign",
            "protocol": PROTOCOL,
            "flowalign_version": flowalign.__version__,
            "rewards": {name: {"version": reward_version(name, fn),
                               "class": f"{type(fn).__module__}.{type(fn).__qualname__}",
                               "kwargs": kwargs.get(name, {}), "groupwise": is_groupwise(fn),
                               "score_range": score_range(name), "modality": reward_modality(fn)}
                        for name, fn in self.rewards.items()},
            "image_size": None if size is None else [size, size],
            "batch_size": self.config.batch_size,
            "encodings": list(ENCODINGS),
        }

    # --------------------------------------------------------------------------------------------- scoring
    def _score(self, name: str, jobs: list[_Job]) -> list[Tensor]:
        """Score ``jobs`` in one call of reward ``name`` (a groupwise reward: one job); each job's float32 scores."""
        from flowalign.rewards import is_groupwise, score_all

        fn = self.rewards[name]
        images = jobs[0].images if len(jobs) == 1 else torch.cat([job.images for job in jobs])
        prompts = [p for job in jobs for p in job.prompts]
        metadata = [m for job in jobs for m in job.metadata]
        group_ids = None
        if is_groupwise(fn):
            group_ids = jobs[0].group_ids if jobs[0].group_ids is not None else [0] * len(jobs[0])
        with torch.no_grad():
            raw = score_all([(name, 1.0, fn)], images, prompts, metadata, group_ids=group_ids).raw[0].cpu()
        return list(raw.split([len(job) for job in jobs]))

    async def _batcher(self, name: str) -> None:
        """Merge waiting jobs of reward ``name`` up to ``batch_size`` images and score them (module docstring)."""
        from flowalign.rewards import is_groupwise

        queue, loop = self.queues[name], asyncio.get_running_loop()
        groupwise = is_groupwise(self.rewards[name])
        held: _Job | None = None
        while True:
            first = held if held is not None else await queue.get()
            held = None
            batch, count = [first], len(first)
            deadline = loop.time() + self.config.batch_wait_ms / 1000
            while not groupwise and count < self.config.batch_size:
                try:
                    job = queue.get_nowait()
                except asyncio.QueueEmpty:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    try:
                        job = await asyncio.wait_for(queue.get(), remaining)
                    except asyncio.TimeoutError:
                        break
                if job.key() != first.key() or count + len(job) > self.config.batch_size:
                    held = job  # it starts the next batch
                    break
                batch.append(job)
                count += len(job)
            live = [job for job in batch if not job.future.done()]  # a cancelled request is not scored
            if not live:
                continue
            await self._score_batch(name, live)

    async def _score_batch(self, name: str, jobs: list[_Job]) -> None:
        """Score ``jobs`` in one call and hand each its scores. When the call fails and it held several requests'
        jobs, each job is scored again alone, so that the failure reaches only the request that caused it."""
        loop = asyncio.get_running_loop()
        try:
            scores = await loop.run_in_executor(self.executor, self._score, name, jobs)
        except Exception as error:  # noqa: BLE001 - handed to the request that caused it
            if len(jobs) > 1:
                for job in jobs:
                    if not job.future.done():  # a request cancelled meanwhile is not scored again
                        await self._score_batch(name, [job])
                return
            if not jobs[0].future.done():
                jobs[0].future.set_exception(error)
            return
        self.served["batches"] += 1
        for job, row in zip(jobs, scores):
            if not job.future.done():
                job.future.set_result(row)

    async def score(self, request: ScoreRequest) -> dict[str, Tensor]:
        """The scores of every reward the request names (each cut into jobs of at most ``batch_size``)."""
        loop = asyncio.get_running_loop()
        size = self.config.batch_size
        futures: dict[str, list[asyncio.Future]] = {}
        for name in request.rewards:
            from flowalign.rewards import is_groupwise

            pieces = [(0, len(request))] if is_groupwise(self.rewards[name]) else [
                (start, min(start + size, len(request))) for start in range(0, len(request), size)]
            futures[name] = []
            for start, stop in pieces:
                future = loop.create_future()
                group_ids = None if request.group_ids is None else request.group_ids[start:stop]
                await self.queues[name].put(_Job(request.images[start:stop], request.prompts[start:stop],
                                                 request.metadata[start:stop], group_ids, future))
                futures[name].append(future)
        every = [future for pending in futures.values() for future in pending]
        try:
            await asyncio.gather(*every)
        except BaseException:  # a failed piece, or the request cancelled (its client went away): drop the rest
            for future in every:
                if not future.cancel() and not future.cancelled():
                    future.exception()  # retrieved: its request is answered with the first failure
            raise
        return {name: torch.cat([future.result() for future in pending]) for name, pending in futures.items()}

    def prepare(self, request: ScoreRequest) -> ScoreRequest:
        """Each served reward's checks of one request, before it is merged into a batch: the files its metadata
        names (``reads_files``, under ``files_root``; module docstring) and the reward's ``check_inputs``. A
        refusal is a ``WireError`` (400) or a ``RewardInputError`` (422)."""
        from flowalign.rewards import files_read, reward_modality

        metadata = request.metadata
        for name in request.rewards:
            fn = self.rewards[name]
            kind = reward_modality(fn)
            if kind == "image" and request.is_video:
                raise WireError(f"reward {name!r} scores images and this request holds videos: send images, or serve "
                                "it with frames: {aggregate: mean} (its frame aggregation)", status=422)
            if kind == "video" and not request.is_video:
                raise WireError(f"reward {name!r} scores videos [B, F, 3, H, W] and this request holds images",
                                status=422)
            keys = files_read(fn)
            if keys:
                metadata = [self._confined(entry, keys, index) for index, entry in enumerate(metadata)]
            check = getattr(fn, "check_inputs", None)
            if callable(check):
                check(list(request.prompts), list(metadata))
        request.metadata = metadata
        return request

    def _confined(self, entry: dict, keys: tuple[str, ...], index: int) -> dict:
        """``entry`` with the paths under ``keys`` resolved under ``files_root``; any other path is a WireError
        naming the sample and key only (module docstring)."""
        entry = dict(entry)
        for key in keys:
            if key not in entry:
                continue
            value = entry[key]
            many = isinstance(value, list)
            paths = value if many else [value]
            resolved = []
            for position, path in enumerate(paths):
                where = f"metadata[{index}][{key!r}]" + (f"[{position}]" if many else "")
                found = self._resolve(path)
                if found is None:
                    raise WireError(f"{where} does not name a readable file under the server's files_root (give a "
                                    "path relative to that directory)")
                resolved.append(found)
            entry[key] = resolved if many else resolved[0]
        return entry

    def _resolve(self, path: Any) -> str | None:
        """The resolved path of a file under ``files_root``, or None: not a string, outside the root after symlinks
        and ``..``, missing, or not a regular file all read the same."""
        if self.files_root is None or not isinstance(path, str) or not path or "\0" in path:
            return None
        try:
            candidate = Path(path)
            resolved = (candidate if candidate.is_absolute() else self.files_root / candidate).resolve()
            if resolved.is_relative_to(self.files_root) and resolved.is_file():
                return str(resolved)
        except (OSError, ValueError, RuntimeError):
            pass
        return None

    # --------------------------------------------------------------------------------------------- HTTP
    def app(self):
        """The aiohttp application: routes, the token middleware, and the batchers' start and stop."""
        from aiohttp import web

        @web.middleware
        async def errors_and_token(request, handler):
            if request.path != "/health" and not self.authorized(request):
                    reason = "missing" if not request.headers.get("Authorization") else "wrong"
                    return web.json_response({"error": f"unauthorized: {reason} bearer token (send "
                                                       "'Authorization: Bearer <token>')"}, status=401)
            try:
                return await handler(request)
            except web.HTTPException as error:
                if error.status < 400:
                    raise
                return web.json_response({"error": error.reason if error.text is None else
                                          f"{error.reason}: {error.text}"}, status=error.status)

        application = web.Application(middlewares=[errors_and_token],
                                      client_max_size=int(self.config.max_request_mb * 2**20))
        application.router.add_get("/health", self._health)
        application.router.add_get("/v1/metadata", self._metadata)
        application.router.add_post("/v1/score", self._score_handler)
        application.on_startup.append(self._start_batchers)
        application.on_cleanup.append(self._stop_batchers)
        return application

    async def _start_batchers(self, app) -> None:
        self.slots = asyncio.Semaphore(self.config.max_concurrency)
        for name in self.rewards:
            self.queues[name] = asyncio.Queue()
            self.workers.append(asyncio.get_running_loop().create_task(self._batcher(name)))

    async def _stop_batchers(self, app) -> None:
        for task in self.workers:
            task.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)
        self.executor.shutdown(wait=True)

    def authorized(self, request) -> bool:
        """Whether ``request`` carries the bearer token (always, when the server has none)."""
        if self.token is None:
            return True
        header = request.headers.get("Authorization", "")
        given = header[7:] if header.startswith("Bearer ") else ""
        return bool(given) and hmac.compare_digest(given.encode(), self.token.encode())

    async def _health(self, request):
        from aiohttp import web

        if self.token is not None and not self.authorized(request):
            return web.json_response({"status": "ok"})  # for probes: no counts without the token
        return web.json_response({"status": "ok", "served": dict(self.served)})

    async def _metadata(self, request):
        from aiohttp import web

        return web.json_response(self.metadata())

    async def _score_handler(self, request):
        from aiohttp import web

        def error(message: str, status: int, **headers):
            return web.json_response({"error": message}, status=status, headers=headers or None)

        config = self.config
        if self.waiting >= config.max_queued + (0 if self.slots.locked() else config.max_concurrency):
            return error(f"busy: {config.max_concurrency} requests in flight and {self.waiting} waiting; retry later",
                         503, **{"Retry-After": "1"})
        content_type = request.headers.get("Content-Type", "")
        limit = int(config.max_request_mb * 2**20)
        if request.content_length is not None and request.content_length > limit:
            return error(f"the body has {request.content_length} bytes, more than the server's max_request_mb "
                         f"{config.max_request_mb:g} MiB", 413)
        self.waiting += 1
        try:
            try:  # the whole body, before a slot is taken
                body = await asyncio.wait_for(request.read(), config.read_timeout)
            except asyncio.TimeoutError:
                return error(f"the body did not arrive within the server's read_timeout {config.read_timeout:g} s",
                             408)
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        try:
            loop = asyncio.get_running_loop()
            try:  # decoding (PNG, safetensors) and each reward's checks of this request, off the event loop
                parsed = await loop.run_in_executor(None, lambda: decode_request(body, content_type,
                                                                                 limits=self.limits))
                unknown = [name for name in parsed.rewards if name not in self.rewards]
                if unknown:
                    return error(f"reward {unknown[0][:100]!r} is not served here; served: {', '.join(self.rewards)}",
                                 404)
                parsed = await loop.run_in_executor(None, self.prepare, parsed)
            except WireError as refused:
                return error(str(refused), refused.status)
            except RewardInputError as refused:
                return error(f"refused by the reward: {refused}", 422)
            try:
                scores = await self.score(parsed)
            except Exception as failure:  # noqa: BLE001 - the reward failed
                refused = _input_error(failure)
                if refused is not None:
                    return error(f"refused by the reward: {refused}", 422)
                logger.exception("scoring failed")
                return error(f"scoring failed: the reward raised {type(failure).__name__} (an error of the server; "
                             "its log has the details)", 500)
            self.served["requests"] += 1
            self.served["images"] += len(parsed)
            return web.Response(body=encode_scores(scores), content_type="application/json")
        finally:
            self.slots.release()


def _input_error(error: BaseException) -> RewardInputError | None:
    """The ``RewardInputError`` that ``error`` is or was caused by (``score_all`` chains what a reward raised)."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, RewardInputError):
            return error
        error, seen = error.__cause__, seen + 1
    return None


async def _serve(server: RewardServer, config: ServeRewardConfig, ready: threading.Event | None = None,
                 stop: asyncio.Event | None = None) -> None:
    from aiohttp import web

    runner = web.AppRunner(server.app(), shutdown_timeout=config.shutdown_timeout, access_log=None,
                           handler_cancellation=True)  # a client that goes away cancels its request
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (tests), or no signals
            pass
    if config.port_file:
        tmp = Path(f"{config.port_file}.tmp")
        tmp.write_text(str(port))
        os.replace(tmp, config.port_file)  # whole, so a reader never sees a partial number
    logger.info("serving %s on http://%s:%d (batch_size %d, %s)", ", ".join(server.rewards), config.host, port,
                config.batch_size, "bearer token required" if server.token else "no token")
    if ready is not None:
        ready.set()
    await stop.wait()
    logger.info("shutting down: finishing the requests in flight (at most %g s)", config.shutdown_timeout)
    await runner.cleanup()
    logger.info("stopped after %d requests (%d images)", server.served["requests"], server.served["images"])


def serve(config: ServeRewardConfig) -> None:
    """Build the rewards and serve them until SIGTERM or SIGINT (module docstring)."""
    import ipaddress

    from flowalign.errors import setup_phase

    from PIL import Image

    with setup_phase():
        config.validate()
        server = RewardServer.build(config)
    Image.MAX_IMAGE_PIXELS = config.max_pixels  # PIL's decompression-bomb fence, behind the header checks
    try:
        loopback = ipaddress.ip_address(config.host).is_loopback
    except ValueError:
        loopback = config.host == "localhost"
    if not loopback and server.token is None:
        logger.warning("serving on %s without a token_file: anyone who reaches this address can use the rewards",
                       config.host)
    asyncio.run(_serve(server, config))

