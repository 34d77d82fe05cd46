"""The reward server's wire format (protocol 1): JSON metadata with safetensors or PNG image payloads, never pickle.

A score request is ``POST /v1/score`` with one of two bodies:

* ``Content-Type: application/x-safetensors`` (``encoding: safetensors``, the default): a safetensors file holding one
  tensor ``images`` ``[B, 3, H, W]`` (float32, float16, bfloat16, float64 in [0, 1], or uint8 read as ``k / 255``) and,
  in its ``__metadata__``, the key ``flowalign`` whose value is the JSON request
  ``{"rewards": [names], "prompts": [B strings], "metadata": [B objects], "group_ids": [B ints] (optional)}``. The
  images arrive exactly as the client holds them, so a remote score equals the in-process one bit for bit.
* ``Content-Type: application/json`` (``encoding: png``): the same JSON request with ``"images_png": [B base64 PNG
  strings]`` (8-bit RGB, read as ``k / 255``): about a quarter of float32's bytes before compression, but quantised,
  so scores are those of the 8-bit images.

Videos. In place of images a request may carry videos ``[B, F, 3, H, W]`` (frames first, in [0, 1]): the safetensors
tensor is then named ``videos``, and the JSON body holds ``"videos_png": [B lists of F base64 PNG strings]``. Every
frame of every video must share one size, and every video one frame count. A video counts as one sample (one prompt,
one metadata object, one score); its frames count against ``max_frames`` (per video) and, frame by frame, against
``max_pixels`` and ``max_request_pixels``, all read from the headers before any frame is decoded: the safetensors
shape, the number of strings per video, each PNG's IHDR.

The answer is JSON ``{"protocol": 1, "scores": {name: [B numbers or null]}}``, each score the float32 value the reward
returned (written as a JSON number it reads back exactly); ``null`` is a non-finite score (an invalid sample). An
error is a 4xx or 5xx with ``{"error": message}``.

Both parsers trust nothing: safetensors holds raw arrays and a JSON header (its format cannot run code, unlike
pickle), the header is bounded by the body, and PNGs are decoded by Pillow. Before any image is decoded, every image's
size is read from its header (the safetensors header's shape; a PNG's IHDR, through Pillow's lazy open) and checked
against the ``Limits``: pixels per image, pixels per request, and the server's image size. So a small compressed
image that would decode to gigabytes (a decompression bomb) is refused from its header. Every mistake is a
``WireError`` with a message for the sender, which the server answers with 400 (413 for too many pixels, 415 for
another content type, 422 for another image size); no malformed request gets a 5xx.
"""

from __future__ import annotations

import base64
import io
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = ["DEFAULT_MAX_FRAMES", "DEFAULT_MAX_PIXELS", "DEFAULT_MAX_REQUEST_PIXELS", "PROTOCOL", "SAFETENSORS",
           "Limits", "ScoreRequest",
           "WireError", "decode_request", "decode_scores", "encode_request", "encode_scores", "png_bytes", "read_png"]

PROTOCOL = 1
SAFETENSORS = "application/x-safetensors"
JSON = "application/json"
IMAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8)
SAFETENSORS_DTYPES = ("F32", "F16", "BF16", "F64", "U8")  # IMAGE_DTYPES as a safetensors header names them
DEFAULT_MAX_PIXELS = 16 * 2**20  # per image: 4096 x 4096
DEFAULT_MAX_REQUEST_PIXELS = 64 * 2**20  # per request: 64 images of 1024 x 1024 (768 MiB as float32 RGB)
DEFAULT_MAX_FRAMES = 256  # per video: Wan's 81 frames and HunyuanVideo's 129 fit
SAFETENSORS_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "U8": 1}
ENCODINGS = ("safetensors", "png")


class WireError(ValueError):
    """A request the server cannot read; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class ScoreRequest:
    """A decoded score request: ``images [B, 3, H, W]``, or videos ``[B, F, 3, H, W]``, in [0, 1] (float; uint8 and
    PNG inputs divided by 255)."""

    rewards: list[str]
    images: Tensor
    prompts: list[str]
    metadata: list[dict]
    group_ids: list[int] | None = field(default=None)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def is_video(self) -> bool:
        """Whether the request carries videos ``[B, F, 3, H, W]`` rather than images."""
        return self.images.ndim == 5


# ---------------------------------------------------------------------------------------------- the client's side
def png_bytes(image: Tensor) -> bytes:
    """One image ``[3, H, W]`` in [0, 1] as 8-bit RGB PNG bytes (rounded to the nearest level)."""
    from PIL import Image

    array = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    buffer = io.BytesIO()
    Image.fromarray(array, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def encode_request(rewards: Sequence[str], images: Tensor, prompts: Sequence[str], metadata: Sequence[dict],
                   *, encoding: str = "safetensors", group_ids: Sequence[int] | None = None) -> tuple[bytes, str]:
    """``(body, content_type)`` of a score request (module docstring): ``images [B, 3, H, W]``, or videos
    ``[B, F, 3, H, W]`` (a 5-dimensional tensor travels as ``videos``; the server checks the layout)."""
    from safetensors.torch import save

    field_name = "videos" if images.ndim == 5 else "images"

    header: dict[str, Any] = {"rewards": list(rewards), "prompts": list(prompts), "metadata": list(metadata)}
    if group_ids is not None:
        header["group_ids"] = [int(g) for g in group_ids]
    if encoding == "safetensors":
        tensor = images.detach().cpu().contiguous()
        if tensor.dtype not in IMAGE_DTYPES:
            tensor = tensor.float()
        return save({field_name: tensor}, metadata={"flowalign": json.dumps(header)}), SAFETENSORS
    if encoding == "png":
        def encoded(image: Tensor) -> str:
            return base64.b64encode(png_bytes(image)).decode("ascii")

        header[f"{field_name}_png"] = [[encoded(frame) for frame in video] if images.ndim == 5 else encoded(video)
                                       for video in images]
        return json.dumps(header).encode("utf-8"), JSON
    raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")


def decode_scores(body: bytes, rewards: Sequence[str], batch: int) -> dict[str, Tensor]:
    """The float32 scores ``[batch]`` of each of ``rewards`` in a server's answer; null reads as NaN. A malformed
    answer is a ValueError."""
    answer = json.loads(body.decode("utf-8"))
    scores = answer.get("scores") if isinstance(answer, dict) else None
    if not isinstance(scores, dict):
        raise ValueError(f"the server's answer has no 'scores' object: {str(answer)[:200]}")
    out = {}
    for name in rewards:
        values = scores.get(name)
        if not isinstance(values, list) or len(values) != batch:
            raise ValueError(f"the server's answer has {len(values) if isinstance(values, list) else 'no'} scores "
                             f"for reward {name!r}, expected {batch}")
        if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
            raise ValueError(f"the server's answer for reward {name!r} holds a non-numeric score")
        out[name] = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
    return out


# ---------------------------------------------------------------------------------------------- the server's side
def encode_scores(scores: dict[str, Tensor]) -> bytes:
    """The JSON answer for float32 ``scores`` (non-finite values as null)."""
    out = {name: [v if math.isfinite(v) else None for v in row.float().tolist()] for name, row in scores.items()}
    return json.dumps({"protocol": PROTOCOL, "scores": out}).encode("utf-8")


def _header(data: bytes) -> dict:
    """The JSON header of a safetensors file (bounded by the body; WireError when it is not one)."""
    if len(data) < 8:
        raise WireError("the body is not a safetensors file: shorter than its 8-byte header length")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise WireError(f"the body is not a safetensors file: its header claims {length} bytes, the body has "
                        f"{len(data) - 8}")
    try:
        header = json.loads(data[8 : 8 + length].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise WireError("the body is not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise WireError("the body is not a safetensors file: its header is not a JSON object")
    return header


def _request_fields(header: Any) -> dict:
    if not isinstance(header, dict):
        raise WireError("the request must be a JSON object with rewards, prompts and metadata")
    rewards, prompts = header.get("rewards"), header.get("prompts")
    metadata = header.get("metadata")
    if not isinstance(rewards, list) or not rewards or not all(isinstance(r, str) for r in rewards):
        raise WireError("'rewards' must be a non-empty list of reward names")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise WireError("'prompts' must be a list of strings, one per image")
    if metadata is None:
        metadata = [{} for _ in prompts]
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise WireError("'metadata' must be a list of JSON objects, one per image")
    group_ids = header.get("group_ids")
    if group_ids is not None and (not isinstance(group_ids, list) or not all(
            isinstance(g, int) and not isinstance(g, bool) for g in group_ids)):
        raise WireError("'group_ids' must be a list of integers, one per image")
    return {"rewards": rewards, "prompts": prompts, "metadata": metadata, "group_ids": group_ids}


@dataclass(frozen=True)
class Limits:
    """What a request may hold, checked on the images' sizes as their headers state them, before any image is
    decoded: ``max_pixels`` per image, ``max_request_pixels`` in all, and ``image_size`` (the side of the square images
    the server scores; None = any size). Too many pixels is a 413, another size a 422."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS
    image_size: int | None = None
    max_frames: int = DEFAULT_MAX_FRAMES

    def check_frames(self, counts: Sequence[int]) -> None:
        """``counts``: the frame count of each video, as the request states it; more than ``max_frames`` is a 413,
        none a 400."""
        for index, count in enumerate(counts):
            if count < 1:
                raise WireError(f"video {index} holds no frames")
            if count > self.max_frames:
                raise WireError(f"video {index} has {count} frames, more than the server's max_frames "
                                f"{self.max_frames} per video", status=413)

    def check(self, sizes: Sequence[tuple[int, int]], repeat: int = 1) -> None:
        """``sizes``: ``(height, width)`` of each image (or video frame), as its header states it; ``repeat``: how
        many times the list stands (a batch tensor states one size for all its images and frames)."""
        total = 0
        for index, (height, width) in enumerate(sizes):
            if height < 1 or width < 1:
                raise WireError(f"image {index} is {height}x{width}: it holds no pixels")
            pixels = height * width
            if pixels > self.max_pixels:
                raise WireError(f"image {index} is {height}x{width} = {pixels} pixels, more than the server's "
                                f"max_pixels {self.max_pixels} per image", status=413)
            total += pixels
        total *= repeat
        if total > self.max_request_pixels:
            raise WireError(f"the request holds {total} pixels, more than the server's max_request_pixels "
                            f"{self.max_request_pixels}", status=413)
        size = self.image_size
        for height, width in sizes:
            if size is not None and (height, width) != (size, size):
                raise WireError(f"images are {height}x{width}; this server scores {size}x{size} (its image_size)",
                                status=422)


def _check_images(images: Tensor, fields: dict) -> Tensor:
    batch = int(images.shape[0])
    for name in ("prompts", "metadata", "group_ids"):
        if fields[name] is not None and len(fields[name]) != batch:
            raise WireError(f"got {batch} images and {len(fields[name])} {name}")
    if images.dtype == torch.uint8:
        images = images.float() / 255
    elif images.dtype not in IMAGE_DTYPES:
        raise WireError(f"'images' has dtype {images.dtype}; expected float32, float16, bfloat16, float64 or uint8")
    return images


def _tensor_shape(header: dict, limits: Limits, name: str, data_bytes: int) -> list[int]:
    """The ``name`` entry (``images`` or ``videos``) of a safetensors header, checked (dtype, ``[B, 3, H, W]`` or
    ``[B, F, 3, H, W]``, ``limits``, and that its bytes are all in the body: ``data_bytes`` after the header) before
    the tensor is read."""
    entry = header.get(name)
    if not isinstance(entry, dict):
        raise WireError(f"the safetensors header's {name!r} entry is not an object with dtype, shape and "
                        "data_offsets")
    dtype, shape = entry.get("dtype"), entry.get("shape")
    if dtype not in SAFETENSORS_DTYPES:
        raise WireError(f"{name!r} has dtype {str(dtype)[:20]!r}; expected one of {', '.join(SAFETENSORS_DTYPES)} "
                        "(float32, float16, bfloat16, float64, uint8)")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                               for n in shape):
        raise WireError(f"the safetensors header's {name!r} shape is not a list of sizes")
    video = name == "videos"
    if len(shape) != (5 if video else 4) or shape[-3] != 3:
        layout = "[B, F, 3, H, W]" if video else "[B, 3, H, W]"
        raise WireError(f"{name!r} must be {layout}, got shape {shape[:8]}")
    if shape[0] < 1:
        raise WireError(f"the request holds no {name}")
    if video:
        limits.check_frames([shape[1]])
    limits.check([(shape[-2], shape[-1])], repeat=math.prod(shape[:-3]))
    offsets = entry.get("data_offsets")
    expected = math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(n, int) for n in offsets)
            or offsets[1] - offsets[0] != expected):
        raise WireError(f"the safetensors header's {name!r} data_offsets do not span its {expected} bytes")
    if offsets[0] < 0 or offsets[1] > data_bytes:
        raise WireError(f"the body is truncated: {name!r} needs bytes {offsets[0]}..{offsets[1]} of the data, the "
                        f"body holds {data_bytes}")
    return shape


def read_png(data: bytes, limits: Limits | None = None) -> Tensor:
    """An 8-bit PNG as ``[3, H, W]`` float32 in [0, 1] (WireError when it is not one). Its size is read from its
    header (IHDR) and checked against ``limits`` before any pixel is decoded."""
    return _decode_png(_open_png(data, 0), limits or Limits())


def _open_png(data: bytes, index: int):
    """The lazily opened PNG (its header read, no pixel decoded)."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:  # PIL's own fence (Image.MAX_IMAGE_PIXELS), from the header as well
        raise WireError(f"image {index} has more pixels than the server's limit (PIL's decompression-bomb limit)",
                        status=413) from None
    except Exception as error:  # noqa: BLE001 - any decoder failure is the sender's malformed image
        raise WireError(f"image {index} is not a readable PNG: {type(error).__name__}") from None
    if image.format != "PNG":
        image.close()
        raise WireError(f"image {index} is {image.format}, not PNG")
    return image


def _decode_png(image, limits: Limits, index: int = 0) -> Tensor:
    import numpy

    try:
        with image:
            limits.check([(image.height, image.width)])  # again, next to the decoder
            array = torch.from_numpy(numpy.asarray(image.convert("RGB")).copy())
    except WireError:
        raise
    except Exception as error:  # noqa: BLE001 - any decoder failure is the sender's malformed image
        raise WireError(f"image {index} is not a readable PNG: {type(error).__name__}: {error}") from None
    return array.permute(2, 0, 1).float() / 255


def decode_request(body: bytes, content_type: str, *, limits: Limits | None = None) -> ScoreRequest:
    """Parse a score request (module docstring); every mistake is a ``WireError``. The images' sizes are read from
    the safetensors header or the PNG headers and checked against ``limits`` before any image is decoded."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind not in (SAFETENSORS, JSON):
        raise WireError(f"Content-Type must be {SAFETENSORS} or {JSON}, got {str(content_type)[:100]!r}", status=415)
    limits = limits or Limits()
    try:
        return _decode_safetensors(body, limits) if kind == SAFETENSORS else _decode_json(body, limits)
    except WireError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, OverflowError, UnicodeError) as error:
        # a parser tripped on the sender's bytes in a way no check above names: still the sender's mistake
        raise WireError(f"the request cannot be read: {type(error).__name__}") from None


def _decode_safetensors(body: bytes, limits: Limits) -> ScoreRequest:
    header = _header(body)
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict):
        raise WireError("the safetensors header's __metadata__ must be an object of strings")
    request = meta.get("flowalign")
    if not isinstance(request, str):
        raise WireError("the safetensors body has no 'flowalign' request (a JSON string) in its __metadata__")
    try:
        parsed = json.loads(request)
    except (ValueError, RecursionError):
        raise WireError("__metadata__['flowalign'] is not JSON") from None
    fields = _request_fields(parsed)
    names = set(header) - {"__metadata__"}
    if names not in ({"images"}, {"videos"}):
        raise WireError(f"the safetensors body must hold exactly one tensor, 'images' or 'videos', got "
                        f"{sorted(names)[:8]}")
    (name,) = names
    _tensor_shape(header, limits, name, len(body) - 8 - struct.unpack("<Q", body[:8])[0])
    from safetensors.torch import load

    try:
        images = load(body)[name]
    except Exception as error:  # noqa: BLE001 - a malformed file is the sender's mistake
        raise WireError(f"the safetensors body cannot be read: {error}") from None
    return ScoreRequest(images=_check_images(images, fields), **fields)


def _decode_json(body: bytes, limits: Limits) -> ScoreRequest:
    try:
        parsed = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise WireError("the body is not JSON") from None
    fields = _request_fields(parsed)
    if "videos_png" in parsed:
        if "images_png" in parsed:
            raise WireError("a request carries 'images_png' or 'videos_png', not both")
        return ScoreRequest(images=_check_images(_decode_png_videos(parsed["videos_png"], limits), fields), **fields)
    encoded = parsed.get("images_png")
    if not isinstance(encoded, list) or not all(isinstance(item, str) for item in encoded) or not encoded:
        raise WireError("'images_png' must be a non-empty list of base64 PNG strings")
    try:
        raw = [base64.b64decode(item, validate=True) for item in encoded]
    except ValueError:
        raise WireError("an entry of 'images_png' is not base64") from None
    opened = []
    try:
        for index, data in enumerate(raw):
            opened.append(_open_png(data, index))
        sizes = [(image.height, image.width) for image in opened]
        limits.check(sizes)  # every header, before any pixel is decoded
        if len(set(sizes)) != 1:
            raise WireError("the PNG images of one request must share one size")
        decoded = [_decode_png(image, limits, index) for index, image in enumerate(opened)]
    finally:
        for image in opened:
            image.close()
    return ScoreRequest(images=_check_images(torch.stack(decoded), fields), **fields)


def _decode_png_videos(encoded: Any, limits: Limits) -> Tensor:
    """``videos_png`` (a list per video of base64 PNG frames) as ``[B, F, 3, H, W]``: the frame counts are checked
    against ``max_frames``, and every frame's header against the pixel limits and the first frame's size, before any
    frame is decoded."""
    if not isinstance(encoded, list) or not encoded or not all(
            isinstance(video, list) and all(isinstance(item, str) for item in video) for video in encoded):
        raise WireError("'videos_png' must be a non-empty list of videos, each a list of base64 PNG strings")
    counts = [len(video) for video in encoded]
    limits.check_frames(counts)  # before anything is decoded, base64 included
    if len(set(counts)) != 1:
        raise WireError(f"the videos of one request must share one frame count, got {sorted(set(counts))[:8]}")
    opened = []
    try:
        for v, video in enumerate(encoded):
            for f, item in enumerate(video):
                try:
                    data = base64.b64decode(item, validate=True)
                except ValueError:
                    raise WireError(f"video {v} frame {f} of 'videos_png' is not base64") from None
                opened.append(_open_png(data, len(opened)))
        sizes = [(image.height, image.width) for image in opened]
        limits.check(sizes)  # every frame's header, before any pixel is decoded
        for index, size in enumerate(sizes):
            if size != sizes[0]:
                v, f = divmod(index, counts[0])
                raise WireError(f"video {v} frame {f} is {size[0]}x{size[1]}, but frame 0 of video 0 is "
                                f"{sizes[0][0]}x{sizes[0][1]}: every frame of a request must share one size")
        decoded = [_decode_png(image, limits, index) for index, image in enumerate(opened)]
    finally:
        for image in opened:
            image.close()
    return torch.stack(decoded).reshape(len(encoded), counts[0], *decoded[0].shape)
