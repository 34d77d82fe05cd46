"""The ``remote`` reward: scores from a reward server, with a timeout, retries, a circuit breaker, and NaN on failure.

    reward:
      rewards:
        - name: remote
          kwargs: {url: "http://127.0.0.1:8765", reward: toy_geneval, token_file: ~/.flowalign/reward-token}

``RemoteReward(images, prompts, metadata)`` cuts the batch into requests of at most ``batch_size`` images (default:
the server's), sends up to ``concurrency`` of them at once, and returns one float32 score per image. With the default
``encoding: safetensors`` the images travel exactly as they are, so the scores equal the in-process reward's bit for
bit (``png``: 8-bit images, a quarter of the bytes). A request that fails transiently (no connection, a timeout, a 5xx,
or a 200 whose body is not the scores it asked for: HTML from a proxy, the wrong number of scores) is retried with
exponential backoff behind a circuit breaker (``flowalign.remote.transport``); one that still fails gives NaN for its
images, which ``flowalign.rewards.score_all`` marks invalid and the trainer masks out of the advantages and counts
(``reward_invalid``; ``reward.max_invalid_fraction`` stops a run when too many are). A permanent failure (a 4xx other
than 408/425/429: a 401, a 404, a request the server's reward refuses) is never retried and raises ``ServerRefused``
(a ``flowalign.errors.RunStopped``): it is a mistake to fix, not a sample to skip, and a training run stops cleanly
on it, with its checkpoint saved and one line naming the URL and the status.

Before anything is built or loaded, ``RemoteReward.check_run`` (through ``flowalign.rewards.check_reward_run``)
reads the token file, asks the server for its metadata, and checks that it serves ``reward`` at the run's image size;
each mistake names its setting (``reward.rewards[0].kwargs.url``, ``...token_file``, ``...reward``).

``protocol: flow_grpo`` speaks the reward-server protocol of the flow_grpo ecosystem instead: a pickled
``{"images": [JPEG bytes], "prompts", "meta_datas", "only_strict"}`` posted to ``url``, answered by a pickled dict
whose ``response_key`` (``scores``) holds the scores. Unpickling runs code chosen by whoever answers, so it needs
``allow_pickle: true`` as well, and is for servers you run yourself on a network you trust. The answer is unpickled
with a restricted unpickler (plain containers, numbers, strings and numpy arrays only), which narrows but does not
close that hole.
"""

from __future__ import annotations

import difflib
import io
import json
import logging
import math
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from flowalign.remote.transport import CircuitBreaker, RequestError, Retrying, ServerRefused, TransientError, request
from flowalign.remote.wire import ENCODINGS, decode_scores, encode_request

__all__ = ["PROTOCOLS", "RemoteReward", "model_image_size", "restricted_loads"]

logger = logging.getLogger(__name__)

PROTOCOLS = ("flowalign", "flow_grpo")


def model_image_size(model: str | None) -> tuple[int, int] | None:
    """The default image size of a local diffusers pipeline directory, read from its files without loading it
    (``transformer.sample_size * 2 ** (len(vae.block_out_channels) - 1)``), or None when it does not say."""
    if not model:
        return None
    root = Path(model)
    try:
        transformer = json.loads((root / "transformer" / "config.json").read_text())
        vae = json.loads((root / "vae" / "config.json").read_text())
        side = int(transformer["sample_size"]) * 2 ** (len(vae["block_out_channels"]) - 1)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return side, side


def _as_size(image_size: Any) -> tuple[int, int] | None:
    if image_size is None:
        return None
    if isinstance(image_size, int):
        return image_size, image_size
    return tuple(int(s) for s in image_size)  # type: ignore[return-value]


def _check_kwargs(cls: type, kwargs: Mapping[str, Any], key: str) -> None:
    """Unknown keyword arguments of ``cls`` are a ValueError naming ``key`` with the closest known one
    (``flowalign.rewards.check_reward_kwargs``)."""
    from flowalign.rewards import check_reward_kwargs

    check_reward_kwargs(cls, kwargs, key, cls.name)


def _read_secret(path: str, key: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{key} = {path!r} does not exist: write the token to that file, or leave {key} unset")
    secret = file.read_text().strip()
    if not secret:
        raise ValueError(f"{key} = {path!r} is empty: it must hold the bearer token")
    return secret


class _Unpickler(pickle.Unpickler):
    """Unpickles plain containers, numbers, strings and numpy arrays; any other global is refused."""

    ALLOWED = {
        ("builtins", name) for name in ("list", "dict", "tuple", "set", "frozenset", "int", "float", "bool", "str",
                                        "bytes", "complex")
    } | {
        ("collections", "OrderedDict"), ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"the answer's pickle names {module}.{name}, which is not a plain value: "
                                         "refused")
        return super().find_class(module, name)


def restricted_loads(data: bytes) -> Any:
    """``pickle.loads`` limited to plain values (``_Unpickler``): narrower than pickle, still not safe with a
    server you do not trust."""
    return _Unpickler(io.BytesIO(data)).load()


class RemoteReward:
    """Scores from a reward server (module docstring). Settings:

    ``url`` the server (``http://host:port``; the flow_grpo protocol: the URL to post to); ``reward`` the name to
    score with (default: the server's only reward); ``token_file`` a file holding the bearer token; ``timeout`` seconds
    per request; ``retries`` more attempts after a transient failure, ``backoff`` the first wait and ``backoff_max``
    the longest (doubling in between); ``breaker_failures`` failed requests in a row that open the circuit breaker
    (0: never) and ``breaker_reset`` the seconds it stays open; ``encoding`` ``safetensors`` (exact) or ``png``
    (8-bit); ``batch_size`` images per request (default: the server's); ``concurrency`` requests in flight at once;
    ``protocol`` ``flowalign`` or ``flow_grpo`` (with ``allow_pickle: true``, ``response_key`` and
    ``only_strict``).
    """

    name = "remote"
    modality = "any"  # images or videos [B, F, 3, H, W], as the served reward takes them (flowalign.remote.wire)

    def __init__(self, url: str, reward: str | None = None, *, token_file: str | None = None, timeout: float = 60.0,
                 retries: int = 3, backoff: float = 0.5, backoff_max: float = 30.0, breaker_failures: int = 5,
                 breaker_reset: float = 30.0, encoding: str = "safetensors", batch_size: int | None = None,
                 concurrency: int = 4, protocol: str = "flowalign", allow_pickle: bool = False,
                 response_key: str = "scores", only_strict: bool = False):
        self.settings = dict(url=url, reward=reward, token_file=token_file, timeout=timeout, retries=retries,
                             backoff=backoff, backoff_max=backoff_max, breaker_failures=breaker_failures,
                             breaker_reset=breaker_reset, encoding=encoding, batch_size=batch_size,
                             concurrency=concurrency, protocol=protocol, allow_pickle=allow_pickle,
                             response_key=response_key, only_strict=only_strict)
        self.validate_settings(self.settings, "remote")
        self.url, self.reward, self.timeout = url.rstrip("/") if protocol == "flowalign" else url, reward, timeout
        self.encoding, self.protocol, self.response_key, self.only_strict = encoding, protocol, response_key, only_strict
        self.headers = {} if token_file is None else {
            "Authorization": f"Bearer {_read_secret(token_file, 'token_file')}"}
        self.retrying = Retrying(retries=retries, backoff=backoff, backoff_max=backoff_max,
                                 breaker=CircuitBreaker(breaker_failures, breaker_reset))
        self.concurrency = concurrency
        self.server: dict | None = None
        self.groupwise = False
        self.image_size: tuple[int, int] | None = None
        self.batch_size = batch_size or 64
        if protocol == "flowalign":
            self.server = self.fetch_metadata(url, self.headers, timeout)
            self.reward = self.served_reward(self.server, reward, "reward")
            info = self.server["rewards"][self.reward]
            self.groupwise = bool(info.get("groupwise", False))
            self.image_size = _as_size(self.server.get("image_size"))
            self.batch_size = batch_size or int(self.server.get("batch_size") or 64)
            self.version = info.get("version")
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="remote-reward")
        self._lock = threading.Lock()
        self.failed = 0  # images that got NaN because their request failed

    def __repr__(self) -> str:
        return f"RemoteReward(url={self.url!r}, reward={self.reward!r}, protocol={self.protocol!r})"

    # ---------------------------------------------------------------------------------------- settings
    @staticmethod
    def validate_settings(settings: Mapping[str, Any], key: str) -> None:
        """Ranges and combinations of the settings, as ValueErrors naming ``key.<setting>``."""
        url = settings.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{key}.url must be an http:// or https:// URL, got {url!r}")
        for name in ("timeout", "backoff", "backoff_max", "breaker_reset"):
            value = settings.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0 or (name == "timeout" and value == 0)):
                raise ValueError(f"{key}.{name} must be a number {'> 0' if name == 'timeout' else '>= 0'}, got "
                                 f"{value!r}")
        for name, low in (("retries", 0), ("breaker_failures", 0), ("concurrency", 1), ("batch_size", 1)):
            value = settings.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{key}.{name} must be an integer >= {low}, got {value!r}")
        if settings.get("encoding", "safetensors") not in ENCODINGS:
            raise ValueError(f"{key}.encoding must be one of {', '.join(ENCODINGS)}, got {settings.get('encoding')!r}")
        protocol = settings.get("protocol", "flowalign")
        if protocol not in PROTOCOLS:
            raise ValueError(f"{key}.protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        if protocol == "flow_grpo" and settings.get("allow_pickle") is not True:
            raise ValueError(
                f"{key}.protocol = 'flow_grpo' reads pickled answers, and unpickling runs code chosen by whoever "
                f"answers at {url}: set {key}.allow_pickle: true only for a server you run on a network you trust "
                "(docs/guides/rewards.md#the-flow_grpo-protocol-unsafe), or serve the reward with "
                "`flowalign serve-reward` and keep protocol: flowalign")

    @staticmethod
    def fetch_metadata(url: str, headers: Mapping[str, str], timeout: float, key: str = "") -> dict:
        """The server's ``/v1/metadata``; a server that cannot be reached or refuses the token is a ValueError
        naming ``key.url`` or ``key.token_file``."""
        prefix = f"{key}." if key else ""
        try:
            answer = request(f"{url.rstrip('/')}/v1/metadata", headers=dict(headers), timeout=timeout)
        except TransientError as error:
            raise ValueError(f"{prefix}url = {url!r}: no reward server answers there ({error}); start one with "
                             "`flowalign serve-reward CONFIG`, or fix the URL") from None
        except RequestError as error:
            if error.status == 401:
                raise ValueError(f"{prefix}token_file: the server at {url} refused the token ({error}); give the "
                                 "token file the server reads") from None
            raise ValueError(f"{prefix}url = {url!r} does not answer like a flowalign reward server ({error})") \
                from None
        try:
            meta = answer.json()
        except ValueError:
            meta = None
        if not isinstance(meta, dict) or not isinstance(meta.get("rewards"), dict):
            raise ValueError(f"{prefix}url = {url!r} does not answer like a flowalign reward server (no 'rewards' in "
                             "its /v1/metadata)")
        return meta

    @staticmethod
    def served_reward(meta: dict, reward: str | None, key: str) -> str:
        """``reward``, checked against what the server serves; None picks the server's only reward."""
        served = sorted(meta["rewards"])
        if reward is None:
            if len(served) != 1:
                raise ValueError(f"{key} is not set and the server serves {len(served)} rewards ({', '.join(served)}): "
                                 "name the one to score with")
            return served[0]
        if reward not in meta["rewards"]:
            close = difflib.get_close_matches(reward, served, n=1)
            raise ValueError(f"{key} = {reward!r} is not served by that server; it serves: {', '.join(served)}"
                             + (f"; did you mean {close[0]!r}?" if close else ""))
        return reward

    @classmethod
    def check_run(cls, kwargs: Mapping[str, Any], *, key: str, model: str | None, image_size: Any) -> None:
        """Before anything is built or loaded (``flowalign.rewards.check_reward_run``): the settings, the token file,
        and, for the flowalign protocol, that the server answers, serves ``reward``, and scores the run's image
        size (``image_size``, else ``model``'s default). Each mistake is a ValueError naming its setting."""
        _check_kwargs(cls, kwargs, key)
        if "url" not in kwargs:
            raise ValueError(f"{key}.url is required: the reward server's address (http://host:port)")
        cls.validate_settings(kwargs, key)
        headers = {}
        if kwargs.get("token_file") is not None:
            headers["Authorization"] = f"Bearer {_read_secret(kwargs['token_file'], f'{key}.token_file')}"
        if kwargs.get("protocol", "flowalign") != "flowalign":
            return
        meta = cls.fetch_metadata(kwargs["url"], headers, min(float(kwargs.get("timeout", 60.0)), 30.0), key)
        name = cls.served_reward(meta, kwargs.get("reward"), f"{key}.reward")
        served = _as_size(meta.get("image_size"))
        run = _as_size(image_size) or model_image_size(model)
        if served is not None and run is not None and tuple(served) != tuple(run):
            raise ValueError(f"{key}.url: the server at {kwargs['url']} scores {served[0]}x{served[1]} images with "
                             f"{name!r} (its image_size), and this run samples {run[0]}x{run[1]}: set the run's "
                             f"image size to {served[0]}, or serve the reward with image_size: {run[0]}")

    # ---------------------------------------------------------------------------------------- scoring
    def _post(self, images: Tensor, prompts: list[str], metadata: list[dict], group_ids) -> Tensor:
        if self.protocol == "flow_grpo":
            return self._post_flow_grpo(images, prompts, metadata)
        body, content_type = encode_request([self.reward], images, prompts, metadata, encoding=self.encoding,
                                            group_ids=group_ids)
        headers = {**self.headers, "Content-Type": content_type}
        url = f"{self.url}/v1/score"

        def send() -> Tensor:
            answer = request(url, data=body, headers=headers, timeout=self.timeout)
            try:
                return decode_scores(answer.body, [self.reward], len(prompts))[self.reward]
            except (ValueError, RecursionError) as error:  # a proxy's HTML page, a truncated or wrong answer
                text = " ".join(str(error).split())[:200]
                raise TransientError(f"{url}: HTTP {answer.status} with a body that is not the {len(prompts)} scores "
                                     f"asked for ({type(error).__name__}: {text})", answer.status) from None

        return self.retrying(send)

    def _post_flow_grpo(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        from PIL import Image

        jpegs = []
        for image in images:
            array = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
            buffer = io.BytesIO()
            Image.fromarray(array).save(buffer, format="JPEG")
            jpegs.append(buffer.getvalue())
        body = pickle.dumps({"images": jpegs, "prompts": list(prompts), "meta_datas": list(metadata),
                             "only_strict": self.only_strict})
        answer = self.retrying(lambda: request(self.url, data=body, headers=dict(self.headers), timeout=self.timeout))
        try:
            data = restricted_loads(answer.body)
            values = data[self.response_key]
            scores = torch.tensor([float(v) for v in list(values)], dtype=torch.float32)
        except Exception as error:  # noqa: BLE001 - a malformed answer: the request failed
            raise TransientError(f"{self.url}: the answer is not a pickled dict with {self.response_key!r} scores "
                                 f"({type(error).__name__}: {error})") from None
        if scores.shape != (len(prompts),):
            raise TransientError(f"{self.url}: {scores.numel()} scores for {len(prompts)} images")
        return scores

    def _piece(self, images: Tensor, prompts: list[str], metadata: list[dict], group_ids) -> Tensor:
        """One request's scores, or NaN for each of its images when it fails transiently (logged)."""
        try:
            return self._post(images, prompts, metadata, group_ids)
        except RequestError as error:
            raise ServerRefused(f"remote reward {self.reward!r}", error) from None
        except TransientError as error:
            with self._lock:
                self.failed += len(prompts)
            logger.warning("remote reward %r: %d images scored NaN (invalid): %s", self.reward, len(prompts), error)
            return torch.full((len(prompts),), math.nan, dtype=torch.float32)

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        """Float32 scores ``[B]``; NaN for the images of requests that failed (module docstring)."""
        prompts = list(prompts)
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        batch = int(images.shape[0])
        if len(prompts) != batch or len(metadata) != batch:
            raise ValueError(f"remote reward: got {batch} images, {len(prompts)} prompts, {len(metadata)} metadata")
        if batch == 0:
            return torch.zeros(0)
        if self.image_size is not None and tuple(images.shape[-2:]) != tuple(self.image_size):
            raise ValueError(f"remote reward {self.reward!r}: the server scores {self.image_size[0]}x"
                             f"{self.image_size[1]} images, got {images.shape[-2]}x{images.shape[-1]}")
        metadata = [json.loads(json.dumps(m, default=str)) for m in metadata]  # what JSON carries, checked here
        size = batch if self.groupwise else self.batch_size
        starts = list(range(0, batch, size))
        group_ids = [0] * batch if self.groupwise else None  # score_all hands a groupwise reward one group a call
        pieces = [(images[s:s + size], prompts[s:s + size], metadata[s:s + size],
                   None if group_ids is None else group_ids[s:s + size]) for s in starts]
        if len(pieces) == 1:
            return self._piece(*pieces[0])
        return torch.cat(list(self._pool.map(lambda piece: self._piece(*piece), pieces)))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
