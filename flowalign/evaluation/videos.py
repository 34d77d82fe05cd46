"""Video helpers for outputs: mp4 files, frame strips, tiled grid videos and GIF bytes for trackers.

A video is ``[F, 3, H, W]`` with values in [0, 1] (one row of the decoded ``[B, F, 3, H, W]``,
``docs/guides/video.md``). The rules:

* **mp4** (``write_mp4``): written through PyAV (FFmpeg's libraries) as H.264 (libx264, ``crf`` 18) when the
  installed FFmpeg has that encoder, else MPEG-4 part 2 (``mpeg4``), in ``yuv420p``, the pixel format every player
  reads, at ``fps`` frames per second. yuv420p stores colour at half resolution, so both sides must be even: an odd
  height or width is padded to the next even size by repeating the last row or column (the file is then one pixel
  taller or wider than the video; nothing is cropped). The file is written to a temporary sibling and renamed into
  place (``flowalign.outputs.write_atomically``). Colours come back within the codec's loss (``read_mp4``).
* **Frame strip** (``frame_strip``, ``save_frame_strip``): the frames side by side left to right, no gap, at the
  video's own size; a video of more than ``max_frames`` frames shows ``max_frames`` evenly spaced ones, always the
  first and the last (``strip_indices``); ``max_frames = 0`` shows every frame.
* **Grid video** (``grid_frames``): several videos of one size tiled per frame, row-major, ``columns`` per row,
  ``PAD`` white pixels around each tile, as ``save_grid`` lays images out; made a frame at a time and written so
  (``write_mp4_frames``), never held whole.
* **GIF** (``gif_bytes``): the animated GIF a tracker's image panel plays (TensorBoard's video summary is one),
  shrunk to a largest side when asked.

``read_mp4`` decodes a file back (frames, size, fps, codec); it checks the stream's declared size and frame count
against its limits before it decodes a frame.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from fractions import Fraction
from os import PathLike
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from flowalign.evaluation.images import to_uint8
from flowalign.outputs import write_atomically

__all__ = ["DEFAULT_FPS", "MP4_CODECS", "PAD", "DecodedVideo", "captioned_strips", "check_fps", "check_strip_frames",
           "frame_strip", "gif_bytes", "grid_frames", "mp4_codec", "read_mp4", "save_frame_strip", "strip_indices",
           "strips_of", "video_frames", "write_mp4", "write_mp4_frames"]

DEFAULT_FPS = 16  # Wan's published frame rate: the fps of a model that declares none
MP4_CODECS = ("libx264", "mpeg4")  # in order of preference: H.264 when FFmpeg has it
CODEC_OPTIONS = {"libx264": {"crf": "18"}, "mpeg4": {}}
MPEG4_BITS_PER_PIXEL = 4  # mpeg4 has no crf: a bit rate this many bits per pixel and frame keeps toy frames sharp
PAD = 2
BACKGROUND = 255
STRIP_HEIGHT = 128  # a captioned strip grid upscales frames to about this height


def check_fps(fps: Any, key: str = "fps") -> Fraction:
    """``fps`` as an exact ``Fraction`` (``29.97`` -> ``2997/100``); ValueError naming ``key`` unless it is a finite
    number > 0 and at most 1000."""
    ok = isinstance(fps, (int, float, Fraction)) and not isinstance(fps, bool) and math.isfinite(fps) and 0 < fps <= 1000
    if not ok:
        raise ValueError(f"{key} must be a number of frames per second in (0, 1000], got {fps!r}")
    return Fraction(fps).limit_denominator(1001)


def mp4_codec() -> str:
    """The first encoder of ``MP4_CODECS`` the installed FFmpeg (PyAV's) has."""
    import av

    for name in MP4_CODECS:
        try:
            av.codec.Codec(name, "w")
        except Exception:  # av.codec.codec.UnknownCodecError: not built into this FFmpeg
            continue
        return name
    raise RuntimeError(f"PyAV's FFmpeg has none of the mp4 encoders {', '.join(MP4_CODECS)}: reinstall av (pip install av)")


def video_frames(video: Any) -> np.ndarray:
    """A video ``[F, 3, H, W]`` in [0, 1] (torch or numpy) -> ``[F, H, W, 3]`` uint8 (``to_uint8``'s rounding)."""
    shape = tuple(video.shape)
    if len(shape) != 4 or shape[1] != 3 or shape[0] < 1:
        raise ValueError(f"expected a video shaped [F, 3, H, W] with F >= 1, got shape {list(shape)}")
    return to_uint8(video)


def _pad_even(frames: np.ndarray) -> np.ndarray:
    """``[F, H, W, 3]`` padded to even ``H`` and ``W`` by repeating the last row / column (yuv420p needs both even)."""
    height, width = frames.shape[1:3]
    pad = ((0, 0), (0, height % 2), (0, width % 2), (0, 0))
    return np.pad(frames, pad, mode="edge") if height % 2 or width % 2 else frames


def write_mp4(video: Any, path: str | PathLike[str], fps: float = DEFAULT_FPS, *, codec: str | None = None) -> Path:
    """Write ``video`` ``[F, 3, H, W]`` in [0, 1] to ``path`` as an mp4 (module docstring: codec, yuv420p, even
    sizes, atomic); returns the path."""
    return write_mp4_frames(iter(video_frames(video)), path, fps, codec=codec)


def write_mp4_frames(frames: Iterator[np.ndarray], path: str | PathLike[str], fps: float = DEFAULT_FPS, *,
                     codec: str | None = None) -> Path:
    """``write_mp4`` of frames ``[H, W, 3]`` uint8 taken one at a time from ``frames`` (all of one size), so that a
    long or large video (a grid) is never held whole."""
    import av

    rate = check_fps(fps)
    codec = codec or mp4_codec()
    path = Path(path)
    with write_atomically(path) as tmp:
        with av.open(str(tmp), "w", format="mp4") as container:
            stream = None
            for pixels in frames:
                pixels = _pad_even(pixels[None])[0]
                if stream is None:
                    height, width = pixels.shape[:2]
                    stream = container.add_stream(codec, rate=rate)
                    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
                    stream.options = dict(CODEC_OPTIONS.get(codec, {}))
                    if codec == "mpeg4":
                        stream.bit_rate = max(200_000, int(MPEG4_BITS_PER_PIXEL * width * height * float(rate)))
                for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                    container.mux(packet)
            if stream is None:
                raise ValueError(f"{path}: a video needs at least one frame")
            for packet in stream.encode():  # flush the encoder's delayed frames
                container.mux(packet)
    return path


@dataclass(frozen=True)
class DecodedVideo:
    """What ``read_mp4`` found: ``frames [F, H, W, 3]`` uint8, the stream's frame rate and codec name."""

    frames: np.ndarray
    fps: Fraction
    codec: str


def read_mp4(path: str | PathLike[str], *, max_frames: int = 10_000, max_pixels: int = 4096 * 4096) -> DecodedVideo:
    """Decode the first video stream of ``path``. ValueError naming the file when it has no video stream, declares
    a frame larger than ``max_pixels`` or more than ``max_frames`` frames (checked before decoding, and again while
    decoding for a stream that declares no count)."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError(f"{path}: no video stream")
        stream = container.streams.video[0]
        if stream.width * stream.height > max_pixels:
            raise ValueError(f"{path}: frames of {stream.width}x{stream.height} exceed the limit of {max_pixels} pixels")
        if stream.frames > max_frames:
            raise ValueError(f"{path}: {stream.frames} frames exceed the limit of {max_frames}")
        frames = []
        for frame in container.decode(stream):
            if len(frames) == max_frames:
                raise ValueError(f"{path}: more than {max_frames} frames")
            frames.append(frame.to_ndarray(format="rgb24"))
        rate = stream.average_rate or stream.guessed_rate
        return DecodedVideo(np.stack(frames), Fraction(rate), stream.codec_context.name)


def strip_indices(count: int, max_frames: int) -> list[int]:
    """The frames a strip shows: all ``count`` when ``max_frames`` is 0 or at least ``count``, else ``max_frames``
    evenly spaced ones from the first to the last (rounded to the nearest index)."""
    if count < 1 or max_frames < 0:
        raise ValueError(f"strip_indices needs count >= 1 and max_frames >= 0, got {count}, {max_frames}")
    if max_frames == 0 or max_frames >= count:
        return list(range(count))
    if max_frames == 1:
        return [0]
    return [int(round(i * (count - 1) / (max_frames - 1))) for i in range(max_frames)]


def frame_strip(video: Any, max_frames: int = 0) -> np.ndarray:
    """The frame strip of ``video`` ``[F, 3, H, W]``: ``[H, k * W, 3]`` uint8, frames ``strip_indices(F, max_frames)``
    side by side."""
    frames = video_frames(video)
    return np.concatenate(list(frames[strip_indices(len(frames), max_frames)]), axis=1)


def save_frame_strip(video: Any, path: str | PathLike[str], max_frames: int = 0) -> Path:
    """Write ``frame_strip(video, max_frames)`` to ``path`` as a PNG, atomically; returns the path."""
    from PIL import Image

    path = Path(path)
    with write_atomically(path) as tmp:
        Image.fromarray(frame_strip(video, max_frames)).save(tmp, format="PNG")
    return path


def grid_frames(videos: Any, columns: int = 4) -> Iterator[np.ndarray]:
    """Videos ``[B, F, 3, H, W]`` in [0, 1] tiled per frame into one grid video, yielded a frame ``[H', W', 3]``
    uint8 at a time: ``min(columns, B)`` per row, ``PAD`` white pixels around each tile."""
    shape = tuple(videos.shape)
    if len(shape) != 5 or shape[2] != 3 or shape[0] < 1:
        raise ValueError(f"expected videos shaped [B, F, 3, H, W] with B >= 1, got shape {list(shape)}")
    if columns < 1:
        raise ValueError(f"columns must be >= 1, got {columns}")
    count, frames, _, height, width = shape
    ncols = min(columns, count)
    nrows = math.ceil(count / ncols)
    cell_h, cell_w = height + 2 * PAD, width + 2 * PAD
    for f in range(frames):
        grid = np.full((nrows * cell_h, ncols * cell_w, 3), BACKGROUND, dtype=np.uint8)
        for index, pixels in enumerate(to_uint8(videos[:, f])):
            row, col = divmod(index, ncols)
            y0, x0 = row * cell_h + PAD, col * cell_w + PAD
            grid[y0 : y0 + height, x0 : x0 + width] = pixels
        yield grid


def gif_bytes(frames: Iterable[np.ndarray], fps: float = DEFAULT_FPS, *, max_side: int | None = None) -> bytes:
    """Frames ``[H, W, 3]`` uint8 as an animated GIF (PIL, looping, ``1000 / fps`` ms a frame); with ``max_side``,
    frames whose longer side exceeds it are shrunk (box filter) to fit."""
    from PIL import Image

    rate = check_fps(fps)
    images = []
    for frame in frames:
        image = Image.fromarray(frame)
        if max_side is not None and max(image.size) > max_side:
            ratio = max_side / max(image.size)
            image = image.resize((max(1, round(image.width * ratio)), max(1, round(image.height * ratio))),
                                 resample=Image.Resampling.BOX)
        images.append(image)
    if not images:
        raise ValueError("a GIF needs at least one frame")
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], loop=0,
                   duration=max(1, round(1000 / float(rate))), optimize=False)
    return buffer.getvalue()


def strips_of(videos: Any, max_frames: int = 0) -> np.ndarray:
    """Each video's frame strip, ``[B, 3, H, k * W]`` float in [0, 1]: images that ``save_grid`` lays out."""
    strips = [frame_strip(video, max_frames) for video in videos]
    return np.stack(strips).transpose(0, 3, 1, 2).astype(np.float32) / 255.0


def check_strip_frames(value: Any, key: str) -> int:
    """``value`` when it is an int >= 0 (a frame strip's frame count, 0 = every frame); ValueError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0 (frames shown in a frame strip, 0 = all), got {value!r}")
    return value


def captioned_strips(videos: Any, captions: Sequence[str], path: str | PathLike[str], *, max_frames: int = 0,
                     columns: int = 1) -> Path:
    """A captioned grid PNG of the videos' frame strips (``save_grid`` of ``strips_of``), written atomically. Frames
    are upscaled (nearest) to about ``STRIP_HEIGHT`` pixels, at most 4 times: toy frames stay legible, large ones
    are not enlarged."""
    from flowalign.evaluation.images import save_grid

    strips = strips_of(videos, max_frames)
    scale = max(1, min(4, STRIP_HEIGHT // strips.shape[2]))
    path = Path(path)
    with write_atomically(path) as tmp:
        save_grid(strips, list(captions), tmp, columns=columns, scale=scale)
    return path
