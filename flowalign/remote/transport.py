"""The client side of HTTP: one request with a timeout, retries with exponential backoff, and a circuit breaker.

Failures are of two kinds. A *transient* one (no connection, a timeout, a 5xx, 429 Too Many Requests) may pass: it is
retried ``retries`` times, the ``n``-th retry after ``min(backoff * 2 ** (n - 1), backoff_max)`` seconds, and a request
that still fails raises ``TransientError`` (the reward clients turn it into NaN scores, which the trainer masks and
counts). A *permanent* one (any other 4xx: a wrong token, a malformed request, a reward the server does not serve) is
the caller's mistake and raises ``RequestError`` at once, never retried. The reward clients turn a permanent failure
in the middle of a run into ``ServerRefused``, a ``flowalign.errors.RunStopped``: the run stops cleanly, with its
checkpoint saved and a one-line message naming the URL and the status.

The circuit breaker (Nygard, *Release It!*, 2007) stops a client from waiting ``timeout * (retries + 1)`` seconds for
every request while a server is down: after ``failures`` consecutive failed requests it *opens*, and requests fail at
once (``CircuitOpen``, a ``TransientError``) for ``reset_after`` seconds; then one trial request is let through
(*half-open*), whose success closes the circuit and whose failure opens it again.

Only the standard library is used (``urllib``), so a training process needs no event loop and no extra package to
score remotely; the server side is ``flowalign.remote.server`` (aiohttp).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, TypeVar

from flowalign.errors import RunStopped

__all__ = ["CircuitBreaker", "CircuitOpen", "RequestError", "Response", "Retrying", "ServerRefused", "TransientError",
           "request"]

T = TypeVar("T")

TRANSIENT_STATUS = (408, 425, 429)  # and every 5xx


class TransientError(RuntimeError):
    """A failure that may pass: no connection, a timeout, a 5xx or 429 answer (``status`` when there was one)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class CircuitOpen(TransientError):
    """The circuit breaker is open: the request was not sent."""


class RequestError(RuntimeError):
    """A permanent failure: the server answered with a 4xx other than 408/425/429 (``status``; ``url``, and
    ``reason``, the error the server gave)."""

    def __init__(self, message: str, status: int, *, url: str = "", reason: str = ""):
        super().__init__(message)
        self.status, self.url, self.reason = status, url, reason


_HINTS = {
    401: "give the token file the server reads (token_file), or restart the server with the token it had",
    403: "give the token file the server reads (token_file)",
    404: "check the url and the reward name (is the server at that address still serving that reward?)",
    413: "lower the client's batch_size, or raise the server's max_request_mb / max_pixels",
    422: "the server's reward refused the request: fix what the error names (a prompt's metadata, the image size)",
}


class ServerRefused(RunStopped):
    """A server refused a request of a running job for good (a 401 or 404 mid-run, a request its reward refuses):
    the run stops cleanly (``flowalign.errors.RunStopped``); the message is one line naming who asked, the URL, the
    status, the server's reason and what to fix."""

    def __init__(self, who: str, error: RequestError):
        reason = " ".join(error.reason.split())[:300]  # one line, however the server wrote it
        hint = _HINTS.get(error.status, "fix the request the error names")
        super().__init__(f"{who}: the server at {error.url} answered HTTP {error.status}"
                         + (f" ({reason})" if reason else "") + f", which retrying cannot fix: {hint}")
        self.status, self.url = error.status, error.url


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str

    def json(self):
        return json.loads(self.body.decode("utf-8"))


def _error_text(body: bytes) -> str:
    """The ``error`` field of a JSON error body, else the body's first 300 characters."""
    text = body.decode("utf-8", errors="replace")
    try:
        parsed = json.loads(text)
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
            return parsed["error"]
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):  # OpenAI's {"error": {"message"}}
            return str(parsed["error"].get("message", parsed["error"]))
    except ValueError:
        pass
    return text[:300]


def request(url: str, *, data: bytes | None = None, headers: dict[str, str] | None = None,
            timeout: float = 60.0, method: str | None = None, max_bytes: int | None = None) -> Response:
    """One HTTP request; a 2xx answer is returned, anything else raises ``TransientError`` or ``RequestError``
    (module docstring). ``timeout`` bounds the connection and each read, in seconds; an answer body longer than
    ``max_bytes`` (None: no limit) is a ``TransientError``, refused before anything parses it."""
    req = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as answer:
            body = answer.read() if max_bytes is None else answer.read(max_bytes + 1)
            if max_bytes is not None and len(body) > max_bytes:
                raise TransientError(f"{url}: the answer is larger than {max_bytes} bytes; refused")
            return Response(answer.status, body, answer.headers.get("Content-Type", ""))
    except urllib.error.HTTPError as error:
        body = error.read() if error.fp is not None else b""
        message = f"{url}: HTTP {error.code}: {_error_text(body)}"
        if error.code >= 500 or error.code in TRANSIENT_STATUS:
            raise TransientError(message, error.code) from None
        raise RequestError(message, error.code, url=url, reason=_error_text(body)) from None
    except (urllib.error.URLError, http.client.HTTPException, socket.timeout, TimeoutError, ConnectionError,
            OSError) as error:
        reason = getattr(error, "reason", error)
        raise TransientError(f"{url}: {type(reason).__name__}: {reason}") from None


class CircuitBreaker:
    """Opens after ``failures`` consecutive failed requests, for ``reset_after`` seconds (module docstring).
    ``failures = 0`` disables it. Thread-safe; ``clock`` is ``time.monotonic`` unless a test gives another."""

    def __init__(self, failures: int = 5, reset_after: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.failures, self.reset_after, self.clock = failures, reset_after, clock
        self._lock = threading.Lock()
        self._count, self._opened_at, self._trial = 0, None, False

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half-open``."""
        with self._lock:
            if self._opened_at is None:
                return "closed"
            return "half-open" if self.clock() - self._opened_at >= self.reset_after else "open"

    def allow(self) -> bool:
        """Whether a request may be sent now: always when closed; when open, one trial once ``reset_after`` passed."""
        if not self.failures:
            return True
        with self._lock:
            if self._opened_at is None:
                return True
            if self.clock() - self._opened_at >= self.reset_after and not self._trial:
                self._trial = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self._count, self._opened_at, self._trial = 0, None, False

    def failure(self) -> None:
        if not self.failures:
            return
        with self._lock:
            self._count += 1
            if self._trial or self._count >= self.failures:
                self._opened_at, self._trial = self.clock(), False


class Retrying:
    """Retries with exponential backoff behind a circuit breaker (module docstring)."""

    def __init__(self, *, retries: int = 3, backoff: float = 0.5, backoff_max: float = 30.0,
                 breaker: CircuitBreaker | None = None, sleep: Callable[[float], None] = time.sleep):
        self.retries, self.backoff, self.backoff_max = retries, backoff, backoff_max
        self.breaker = breaker or CircuitBreaker(0)
        self.sleep = sleep

    def delay(self, retry: int) -> float:
        """Seconds before retry number ``retry`` (1-based)."""
        return min(self.backoff * 2 ** (retry - 1), self.backoff_max)

    def __call__(self, send: Callable[[], T]) -> T:
        """``send()`` until it succeeds, at most ``retries + 1`` times; ``RequestError`` passes through at once."""
        if not self.breaker.allow():
            raise CircuitOpen(f"circuit open after {self.breaker.failures} failed requests in a row; the next trial "
                              f"in at most {self.breaker.reset_after:g} s")
        last: TransientError | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                self.sleep(self.delay(attempt))
            try:
                out = send()
            except TransientError as error:
                last = error
                continue
            except RequestError:
                self.breaker.success()  # the server answered: it is up
                raise
            self.breaker.success()
            return out
        self.breaker.failure()
        assert last is not None
        raise TransientError(f"{last} (after {self.retries + 1} attempts)", last.status)
