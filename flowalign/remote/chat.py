"""One OpenAI-compatible chat-completions endpoint (vLLM, SGLang, or any server of that shape), as the VLM judges use
it (``flowalign.remote.judge``: a score per image; ``flowalign.remote.pairwise_judge``: a verdict per pair).

``ChatEndpoint`` sends a user message of image parts (``data:image/png;base64,...`` URLs, ``image_part``) and a text to
``{url}/chat/completions`` and returns the answer's text. Each request has a ``timeout`` and ``retries`` with backoff
behind a circuit breaker (``flowalign.remote.transport``); an answer body over ``max_answer_bytes`` is refused before it
is parsed; only the answer's text is read (no path or URL the server names is ever opened). A request that fails after
its retries, or an answer not in the chat-completions shape, gives ``None`` and counts in ``failed``; a permanent
refusal (a 4xx: a wrong key or model) raises ``ServerRefused``, which stops the run. ``probe`` checks, before anything
loads, that a server answers at a URL.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, TypeVar

import torch
from torch import Tensor

from flowalign.remote.transport import CircuitBreaker, RequestError, Retrying, ServerRefused, TransientError, request
from flowalign.remote.wire import png_bytes

__all__ = ["ChatEndpoint", "image_part", "probe"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


def image_part(image: Tensor, resize: int | None = None) -> dict:
    """One ``image_url`` content part: ``image`` ``[3, H, W]`` in [0, 1] as a PNG data URL, resized (bilinear,
    antialiased) to ``resize`` x ``resize`` first when given."""
    if resize is not None and tuple(image.shape[-2:]) != (resize, resize):
        image = torch.nn.functional.interpolate(image[None].float(), size=(resize, resize), mode="bilinear",
                                                antialias=True, align_corners=False)[0]
    data = base64.b64encode(png_bytes(image)).decode("ascii")
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def probe(url: str, timeout: float, key: str) -> None:
    """Before anything loads: a ValueError naming ``key.url`` when nothing answers at ``url`` (a request to
    ``{url}/models``; any answer, an error status included, proves a server is there)."""
    try:
        request(f"{url.rstrip('/')}/models", timeout=min(float(timeout), 30.0))
    except TransientError as error:
        if error.status is None:  # no answer at all (a 5xx still proves a server is there)
            raise ValueError(f"{key}.url = {url!r}: no chat-completions server answers there ({error})") from None
    except RequestError:
        pass  # it answered (a server without /models, or one that wants a key there)


class ChatEndpoint:
    """The endpoint at ``url`` serving ``model`` (module docstring); ``label`` names it in logs and errors."""

    def __init__(self, url: str, model: str, *, label: str, system: str | None = None,
                 api_key_file: str | None = None, max_tokens: int = 32, temperature: float = 0.0,
                 timeout: float = 120.0, retries: int = 2, backoff: float = 0.5, backoff_max: float = 30.0,
                 breaker_failures: int = 5, breaker_reset: float = 30.0, concurrency: int = 8,
                 max_answer_bytes: int | None = None):
        self.url, self.model, self.label, self.system = url.rstrip("/"), model, label, system
        self.max_tokens, self.temperature, self.timeout = max_tokens, temperature, timeout
        self.max_answer_bytes = max_answer_bytes
        self.headers = {"Content-Type": "application/json"}
        if api_key_file is not None:
            self.headers["Authorization"] = f"Bearer {Path(api_key_file).expanduser().read_text().strip()}"
        self.retrying = Retrying(retries=retries, backoff=backoff, backoff_max=backoff_max,
                                 breaker=CircuitBreaker(breaker_failures, breaker_reset))
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=label.replace(" ", "-"))
        self.lock = threading.Lock()
        self.requests = 0  # requests sent (each one, however many retries)
        self.failed = 0  # requests without a usable answer

    def body(self, parts: list[dict], text: str) -> dict:
        """The request body: the system message (if any), then one user message of ``parts`` and ``text``."""
        messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        messages.append({"role": "user", "content": [*parts, {"type": "text", "text": text}]})
        return {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens}

    def ask(self, body: dict, on_failure: str) -> str | None:
        """The answer's text to ``body``, or None (logged with ``on_failure``, what the caller makes of it) when the
        request failed after its retries or the answer is not in the chat-completions shape."""
        data = json.dumps(body).encode("utf-8")
        with self.lock:
            self.requests += 1
        try:
            answer = self.retrying(lambda: request(f"{self.url}/chat/completions", data=data, headers=self.headers,
                                                   timeout=self.timeout, max_bytes=self.max_answer_bytes))
            content = answer.json()["choices"][0]["message"]["content"]
        except RequestError as error:  # permanent: a wrong key, a model the server does not serve
            raise ServerRefused(f"{self.label} {self.model!r}", error) from None
        except (TransientError, ValueError, KeyError, IndexError, TypeError) as error:
            with self.lock:
                self.failed += 1
            logger.warning("%s %r: no usable answer, %s: %s", self.label, self.model, on_failure, error)
            return None
        if isinstance(content, list):  # content parts
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return content if isinstance(content, str) else None

    def map(self, function: Callable[[int], T], count: int) -> list[T]:
        """``function(i)`` for ``i < count``, ``concurrency`` requests in flight, in order."""
        return list(self._pool.map(function, range(count)))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
