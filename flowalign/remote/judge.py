"""The ``vlm_judge`` reward: a vision-language model asked for a score over an OpenAI-compatible chat-completions API.

Each image is one request to ``{url}/chat/completions`` (vLLM, SGLang, or any server of that shape): a user message
holding the image as a ``data:image/png;base64,...`` URL and the prompt template filled with the image's prompt
(``{prompt}``; ``{tag}`` and any other metadata key are filled too), with ``temperature`` 0 by default. The answer is
parsed with a *strict* pattern: ``re.fullmatch(pattern, answer.strip(), re.IGNORECASE)`` must match the whole answer,
and its first group is the score (a number, or a word looked up in ``labels``); a score outside ``[low, high]`` does
not count. With ``normalize`` (the default) the score is mapped to ``(s - low) / (high - low)`` in [0, 1].

An answer that does not parse, or a request that fails after its retries, is an invalid reward: NaN, which
``flowalign.rewards.score_all`` marks invalid and the trainer masks and counts (``reward_invalid``). Unparseable
answers are logged with a count and the first one; every ``log_every``-th answer is logged as well (a sample of what
the judge says, for review). A judge that gives every image of a call the same score (at least ``min_constant``
images) raises a warning: the failure flow_grpo's issue #18 describes, where a misconfigured judge returned a constant
and every group had zero variance, so nothing trained.

Videos. The judge takes videos ``[B, F, 3, H, W]`` as well (``modality: any``): each video is one request whose user
message holds ``video_frames`` evenly spaced frames (the first and the last included;
``flowalign.reward_models.frames.frame_indices``), in order, as that many ``image_url`` parts before the text. The
``video_alignment`` template says so to the judge.

Built-in templates (``template``): ``alignment`` (a 1-10 score of how well the image matches its prompt,
answered ``Score: N``) and ``yes_no`` (does the image show the prompt: ``yes`` 1, ``no`` 0). Any other string is a
template itself (it must contain ``{prompt}``) and then needs its ``pattern``.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from flowalign.remote.chat import ChatEndpoint, image_part, probe

__all__ = ["TEMPLATES", "VLMJudge", "parse_score"]

logger = logging.getLogger(__name__)

TEMPLATES: dict[str, dict[str, Any]] = {
    "alignment": {
        "text": ("You are judging an image generated from a text prompt.\nPrompt: \"{prompt}\"\nRate how well the "
                 "image matches the prompt (objects, counts, colours, positions) from 1 (not at all) to 10 "
                 "(perfectly). Answer with exactly one line: Score: N"),
        "pattern": r"score:\s*(\d+(?:\.\d+)?)",
        "low": 1.0, "high": 10.0, "labels": None,
    },
    "video_alignment": {
        "text": ("You are judging a video generated from a text prompt; the images above are its frames, in order.\n"
                 "Prompt: \"{prompt}\"\nRate how well the video matches the prompt (objects, counts, colours, "
                 "positions, motion) from 1 (not at all) to 10 (perfectly). Answer with exactly one line: Score: N"),
        "pattern": r"score:\s*(\d+(?:\.\d+)?)",
        "low": 1.0, "high": 10.0, "labels": None,
    },
    "yes_no": {
        "text": "Does this image show: \"{prompt}\"? Answer with exactly one word: yes or no.",
        "pattern": r"(yes|no)\.?",
        "low": 0.0, "high": 1.0, "labels": {"yes": 1.0, "no": 0.0},
    },
}


class _Fill(dict):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def parse_score(answer: str, pattern: re.Pattern, labels: Mapping[str, float] | None, low: float,
                high: float) -> float | None:
    """The score in ``answer`` under the strict ``pattern`` (module docstring), or None when it does not parse or
    lies outside ``[low, high]``."""
    match = pattern.fullmatch(answer.strip())
    if match is None:
        return None
    word = match.group(1)
    if labels is not None:
        value = {k.lower(): v for k, v in labels.items()}.get(word.lower())
        if value is None:
            return None
    else:
        try:
            value = float(word)
        except ValueError:
            return None
    if not math.isfinite(value) or not low <= value <= high:
        return None
    return float(value)


class VLMJudge:
    """A VLM judge over chat completions (module docstring). Settings: ``url`` (the API base, e.g.
    ``http://127.0.0.1:8000/v1``), ``model`` (the served model's name), ``template`` (a built-in name or a template
    string), ``system`` (a system message, or None), ``pattern``, ``labels``, ``low``, ``high`` (default: the
    template's), ``normalize``, ``api_key_file``, ``max_tokens``, ``temperature``, ``timeout``, ``retries``,
    ``backoff``, ``backoff_max``, ``breaker_failures``, ``breaker_reset``, ``concurrency`` (requests in flight),
    ``resize`` (the side images are resized to before encoding; None keeps them), ``log_every`` (log every n-th answer;
    0 never), ``min_constant`` (the smallest call whose constant scores warn), ``video_frames`` (the frames sent of
    each video)."""

    name = "vlm_judge"
    score_range = (0.0, 1.0)
    modality = "any"  # images, or videos as video_frames sampled frames (module docstring)

    def __init__(self, url: str, model: str, *, template: str = "alignment", system: str | None = None,
                 pattern: str | None = None, labels: Mapping[str, float] | None = None, low: float | None = None,
                 high: float | None = None, normalize: bool = True, api_key_file: str | None = None,
                 max_tokens: int = 32, temperature: float = 0.0, timeout: float = 120.0, retries: int = 2,
                 backoff: float = 0.5, backoff_max: float = 30.0, breaker_failures: int = 5,
                 breaker_reset: float = 30.0, concurrency: int = 8, resize: int | None = None, log_every: int = 64,
                 min_constant: int = 4, video_frames: int = 4):
        settings = dict(url=url, model=model, template=template, system=system, pattern=pattern, labels=labels,
                        low=low, high=high, normalize=normalize, api_key_file=api_key_file, max_tokens=max_tokens,
                        temperature=temperature, timeout=timeout, retries=retries, backoff=backoff,
                        backoff_max=backoff_max, breaker_failures=breaker_failures, breaker_reset=breaker_reset,
                        concurrency=concurrency, resize=resize, log_every=log_every, min_constant=min_constant,
                        video_frames=video_frames)
        resolved = self.resolve(settings, "vlm_judge")
        self.text, self.pattern = resolved["text"], resolved["pattern"]
        self.labels, self.low, self.high = resolved["labels"], resolved["low"], resolved["high"]
        self.normalize, self.resize, self.log_every, self.min_constant = normalize, resize, log_every, min_constant
        self.video_frames = video_frames
        self.endpoint = ChatEndpoint(url, model, label="vlm_judge", system=system, api_key_file=api_key_file,
                                     max_tokens=max_tokens, temperature=temperature, timeout=timeout,
                                     retries=retries, backoff=backoff, backoff_max=backoff_max,
                                     breaker_failures=breaker_failures, breaker_reset=breaker_reset,
                                     concurrency=concurrency)
        self.answers = 0  # answers received so far (the log_every sample counts them)
        self.unparsed = 0

    @property
    def failed(self) -> int:
        """Requests without a usable answer (each an invalid score)."""
        return self.endpoint.failed

    def __repr__(self) -> str:
        return f"VLMJudge(url={self.endpoint.url!r}, model={self.endpoint.model!r})"

    # ---------------------------------------------------------------------------------------- settings
    @staticmethod
    def resolve(settings: Mapping[str, Any], key: str) -> dict[str, Any]:
        """The template text, compiled pattern, labels and range of ``settings``; every mistake a ValueError naming
        ``key.<setting>``."""
        url = settings.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{key}.url must be the API's http:// or https:// base URL (e.g. "
                             f"http://127.0.0.1:8000/v1), got {url!r}")
        if not isinstance(settings.get("model"), str) or not settings["model"]:
            raise ValueError(f"{key}.model must name the model the API serves, got {settings.get('model')!r}")
        template = settings.get("template", "alignment")
        if not isinstance(template, str) or not template:
            raise ValueError(f"{key}.template must be {' or '.join(TEMPLATES)} or a template string with {{prompt}}")
        builtin = TEMPLATES.get(template)
        if builtin is None and "{prompt}" not in template:
            raise ValueError(f"{key}.template = {template!r} is neither a built-in template ({', '.join(TEMPLATES)}) "
                             "nor a template string with {prompt}")
        source = settings.get("pattern") or (builtin or {}).get("pattern")
        if source is None:
            raise ValueError(f"{key}.pattern is required with a template of your own: a regular expression the whole "
                             "answer must match, whose first group is the score")
        try:
            pattern = re.compile(source, re.IGNORECASE)
        except re.error as error:
            raise ValueError(f"{key}.pattern = {source!r} is not a regular expression: {error}") from None
        if pattern.groups < 1:
            raise ValueError(f"{key}.pattern = {source!r} has no group: its first group must capture the score")
        labels = settings.get("labels") if settings.get("labels") is not None else (builtin or {}).get("labels")
        if labels is not None and (not isinstance(labels, Mapping) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in labels.values())):
            raise ValueError(f"{key}.labels must map answer words to numbers, got {labels!r}")
        low = settings.get("low") if settings.get("low") is not None else (builtin or {}).get("low", -math.inf)
        high = settings.get("high") if settings.get("high") is not None else (builtin or {}).get("high", math.inf)
        if not (isinstance(low, (int, float)) and isinstance(high, (int, float)) and low < high):
            raise ValueError(f"{key}.low and {key}.high must be numbers with low < high, got {low!r} and {high!r}")
        if settings.get("normalize", True) and not (math.isfinite(low) and math.isfinite(high)):
            raise ValueError(f"{key}.normalize maps [low, high] to [0, 1]: set {key}.low and {key}.high, or "
                             "normalize: false")
        for name, lowest in (("max_tokens", 1), ("retries", 0), ("breaker_failures", 0), ("concurrency", 1),
                             ("log_every", 0), ("min_constant", 2), ("resize", 1), ("video_frames", 1)):
            value = settings.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lowest):
                raise ValueError(f"{key}.{name} must be an integer >= {lowest}, got {value!r}")
        for name in ("timeout", "backoff", "backoff_max", "breaker_reset", "temperature"):
            value = settings.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0 or (name == "timeout" and value == 0)):
                raise ValueError(f"{key}.{name} must be a number {'> 0' if name == 'timeout' else '>= 0'}, got "
                                 f"{value!r}")
        api_key = None
        if settings.get("api_key_file") is not None:
            path = Path(settings["api_key_file"]).expanduser()
            if not path.is_file():
                raise ValueError(f"{key}.api_key_file = {settings['api_key_file']!r} does not exist")
            api_key = path.read_text().strip()
        return {"text": (builtin or {}).get("text", template), "pattern": pattern, "labels": labels,
                "low": float(low), "high": float(high), "api_key": api_key}

    @classmethod
    def check_run(cls, kwargs: Mapping[str, Any], *, key: str, model: str | None, image_size: Any) -> None:
        """Before anything is built or loaded: the settings, the key file, and that something answers at ``url``."""
        from flowalign.remote.client import _check_kwargs

        _check_kwargs(cls, kwargs, key)
        for name in ("url", "model"):
            if name not in kwargs:
                raise ValueError(f"{key}.{name} is required")
        cls.resolve(kwargs, key)
        probe(kwargs["url"], kwargs.get("timeout", 120.0), key)

    # ---------------------------------------------------------------------------------------- scoring
    def message(self, image: Tensor, prompt: str, metadata: Mapping[str, Any]) -> dict:
        """The chat-completions request body for one image ``[3, H, W]``, or one video ``[F, 3, H, W]`` (its
        ``video_frames`` sampled frames, in order, one image part each)."""
        from flowalign.reward_models.frames import frame_indices

        frames = image[frame_indices(image.shape[0], count=self.video_frames)] if image.ndim == 4 else image[None]
        fields = _Fill({k: v for k, v in metadata.items() if isinstance(v, (str, int, float))})
        fields["prompt"] = prompt
        return self.endpoint.body([image_part(frame, self.resize) for frame in frames], self.text.format_map(fields))

    def ask(self, image: Tensor, prompt: str, metadata: Mapping[str, Any]) -> str | None:
        """The judge's answer for one image, or None when the request failed after its retries."""
        return self.endpoint.ask(self.message(image, prompt, metadata), "score NaN (invalid)")

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        """Scores ``[B]`` float32: the parsed (and normalised) scores, NaN where invalid (module docstring)."""
        prompts = list(prompts)
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        answers = self.endpoint.map(lambda i: self.ask(images[i], prompts[i], metadata[i]), len(prompts))
        scores, unparsed = [], []
        for i, answer in enumerate(answers):
            value = None if answer is None else parse_score(answer, self.pattern, self.labels, self.low, self.high)
            if answer is not None and value is None:
                unparsed.append(i)
            if value is not None and self.normalize:
                value = (value - self.low) / (self.high - self.low)
            scores.append(math.nan if value is None else value)
            with self.endpoint.lock:
                self.answers += answer is not None
                number = self.answers
            if answer is not None and self.log_every and number % self.log_every == 1 % self.log_every:
                logger.info("vlm_judge %r answer %d for %r: %r -> %s", self.endpoint.model, number, prompts[i],
                            answer, "invalid" if value is None else f"{value:g}")
        if unparsed:
            with self.endpoint.lock:
                self.unparsed += len(unparsed)
            first = unparsed[0]
            logger.warning("vlm_judge %r: %d of %d answers do not match the pattern %r and score NaN (invalid); the "
                           "first, for %r: %r", self.endpoint.model, len(unparsed), len(prompts),
                           self.pattern.pattern, prompts[first], answers[first])
        valid = [s for s in scores if not math.isnan(s)]
        if len(valid) >= self.min_constant and len(valid) == len(scores) and len(set(valid)) == 1:
            logger.warning("vlm_judge %r gave all %d images of this batch the same score %g: a judge that answers a "
                           "constant trains nothing (every group has zero variance; flow_grpo issue #18). Check the "
                           "model name, the template and that the images reach it", self.endpoint.model, len(valid),
                           valid[0])
        return torch.tensor(scores, dtype=torch.float32)

    def close(self) -> None:
        self.endpoint.close()
