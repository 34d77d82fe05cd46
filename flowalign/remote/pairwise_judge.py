"""The ``vlm`` pairwise judge: a vision-language model asked which of two images is better, over an OpenAI-compatible
chat-completions API (vLLM, SGLang, or any server of that shape), as Pref-GRPO's UnifiedReward-Think judge is served.

Each pair is one request to ``{url}/chat/completions``: a user message with the two images as
``data:image/png;base64,...`` URLs (the first image shown first) and the template filled with the pair's prompt
(``{prompt}``), ``temperature`` 0 by default. The answer's text comes back as it is; the pairwise reward parses it
(``flowalign.reward_models.pairwise``: ``think`` or ``flex``). The built-in ``think`` template is our own wording of a
pairwise comparison that reasons first and ends with ``<answer>Image 1 is better</answer>`` (or ``Image 2``); ``flex``
asks for the Flex JSON. Any other string with ``{prompt}`` is a template itself.

Hostile or broken servers. Only the answer's text is read (no path, no URL from the server is ever opened); an answer
body larger than ``max_answer_bytes`` is refused before it is parsed; each request has a ``timeout`` and ``retries``
with backoff behind a circuit breaker (``flowalign.remote.transport``). A request that fails after its retries gives
``None`` (the reward counts the pair as a tie and the failure); a permanent refusal (a 4xx: a wrong key or model)
stops the run (``ServerRefused``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from torch import Tensor

from flowalign.remote.chat import ChatEndpoint, image_part, probe

__all__ = ["PAIRWISE_TEMPLATES", "PairwiseVLMJudge"]

PAIRWISE_TEMPLATES = {
    "think": ("You compare two images generated from the same text prompt.\nPrompt: \"{prompt}\"\nThe first image "
              "is Image 1, the second is Image 2. Weigh how faithfully each one follows the prompt (objects, counts, "
              "colours, positions) and how good it looks. Reason briefly inside <think>...</think>, then give your "
              "verdict inside <answer>...</answer> as exactly one of: Image 1 is better / Image 2 is better."),
    "flex": ("You compare two images generated from the same text prompt.\nPrompt: \"{prompt}\"\nThe first image is "
             "Image 1, the second is Image 2. Answer with one JSON object only: {\"winner\": \"Image 1\" or \"Image "
             "2\", \"categories\": [{\"name\": ..., \"cat_winner\": \"Image 1\" or \"Image 2\"}, ...]} with up to "
             "three categories: prompt alignment, visual quality, composition."),
}


class PairwiseVLMJudge:
    """A pairwise VLM judge over chat completions (module docstring): ``judge(first, second, prompts, metadata)``
    answers one text (or None) per pair. Settings: ``url`` (the API base, e.g. ``http://127.0.0.1:8000/v1``),
    ``model``, ``template`` (``think``, ``flex`` or a string with ``{prompt}``), ``system``, ``api_key_file``,
    ``max_tokens``, ``temperature``, ``timeout``, ``retries``, ``backoff``, ``backoff_max``, ``breaker_failures``,
    ``breaker_reset``, ``concurrency`` (requests in flight), ``resize`` (the side images are resized to; None keeps
    them), ``max_answer_bytes``."""

    name = "vlm"

    def __init__(self, url: str, model: str, *, template: str = "think", system: str | None = None,
                 api_key_file: str | None = None, max_tokens: int = 1024, temperature: float = 0.0,
                 timeout: float = 120.0, retries: int = 2, backoff: float = 0.5, backoff_max: float = 30.0,
                 breaker_failures: int = 5, breaker_reset: float = 30.0, concurrency: int = 8,
                 resize: int | None = None, max_answer_bytes: int = 1 << 20):
        settings = dict(url=url, model=model, template=template, api_key_file=api_key_file, max_tokens=max_tokens,
                        timeout=timeout, retries=retries, concurrency=concurrency, resize=resize,
                        max_answer_bytes=max_answer_bytes, temperature=temperature)
        self.check(settings, "judge_kwargs")
        self.text, self.resize = PAIRWISE_TEMPLATES.get(template, template), resize
        self.endpoint = ChatEndpoint(url, model, label="pairwise judge", system=system, api_key_file=api_key_file,
                                     max_tokens=max_tokens, temperature=temperature, timeout=timeout,
                                     retries=retries, backoff=backoff, backoff_max=backoff_max,
                                     breaker_failures=breaker_failures, breaker_reset=breaker_reset,
                                     concurrency=concurrency, max_answer_bytes=max_answer_bytes)

    @property
    def requests(self) -> int:
        """Pairs sent (each one request, however many retries)."""
        return self.endpoint.requests

    @property
    def failed(self) -> int:
        """Pairs without a usable answer."""
        return self.endpoint.failed

    def __repr__(self) -> str:
        return f"PairwiseVLMJudge(url={self.endpoint.url!r}, model={self.endpoint.model!r})"

    @staticmethod
    def check(settings: Mapping[str, Any], key: str) -> None:
        """Every mistake in ``settings`` is a ValueError naming ``key.<setting>``; nothing is sent."""
        url = settings.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{key}.url must be the API's http:// or https:// base URL (e.g. "
                             f"http://127.0.0.1:8000/v1), got {url!r}")
        if not isinstance(settings.get("model"), str) or not settings["model"]:
            raise ValueError(f"{key}.model must name the model the API serves, got {settings.get('model')!r}")
        template = settings.get("template", "think")
        if not isinstance(template, str) or (template not in PAIRWISE_TEMPLATES and "{prompt}" not in template):
            raise ValueError(f"{key}.template must be {' or '.join(PAIRWISE_TEMPLATES)} or a template string with "
                             f"{{prompt}}, got {template!r}")
        for name, lowest in (("max_tokens", 1), ("retries", 0), ("concurrency", 1), ("resize", 1),
                             ("max_answer_bytes", 1)):
            value = settings.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lowest):
                raise ValueError(f"{key}.{name} must be an integer >= {lowest}, got {value!r}")
        timeout = settings.get("timeout", 120.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"{key}.timeout must be a number > 0 (seconds), got {timeout!r}")
        if settings.get("api_key_file") is not None and not Path(settings["api_key_file"]).expanduser().is_file():
            raise ValueError(f"{key}.api_key_file = {settings['api_key_file']!r} does not exist")

    @classmethod
    def check_run(cls, settings: Mapping[str, Any], key: str) -> None:
        """Before anything is built or loaded: the settings, and that something answers at ``url``."""
        cls.check(settings, key)
        probe(settings["url"], settings.get("timeout", 120.0), key)

    def message(self, first: Tensor, second: Tensor, prompt: str) -> dict:
        """The chat-completions request body for one pair of images ``[3, H, W]`` (``first`` shown first)."""
        return self.endpoint.body([image_part(first, self.resize), image_part(second, self.resize)],
                                  self.text.replace("{prompt}", prompt))

    def ask(self, first: Tensor, second: Tensor, prompt: str) -> str | None:
        """The judge's answer for one pair, or None when the request failed after its retries."""
        return self.endpoint.ask(self.message(first, second, prompt), "the pair counts as a tie")

    def __call__(self, first: Tensor, second: Tensor, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> list[str | None]:
        """One answer per pair ``(first[p], second[p])`` with ``prompts[p]``, in order."""
        return self.endpoint.map(lambda p: self.ask(first[p], second[p], prompts[p]), len(prompts))

    def close(self) -> None:
        self.endpoint.close()
