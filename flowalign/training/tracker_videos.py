"""A sample video in the run's tracker (``train.tracker``): TensorBoard and Weights & Biases both take it.

* **TensorBoard**: an animated GIF in an image summary, the record ``SummaryWriter.add_video`` writes, built here
  without moviepy (which ``add_video`` needs to make the GIF and which flowalign does not install): the GIF of the
  grid video comes from PIL (``flowalign.evaluation.videos.gif_bytes``), shrunk to at most ``GIF_SIDE`` pixels a
  side (a grid of 16 full-size videos would make an event file of hundreds of MB), and goes through the writer's own
  event file. TensorBoard's Images tab plays it.
* **Weights & Biases**: ``wandb.Video`` of the mp4 the run already wrote (``samples/iteration-NNNNNN.mp4``); from
  a file, wandb needs no moviepy either (from an array it would).

Only the main process has trackers (accelerate's ``init_trackers``); other trackers are left alone.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

__all__ = ["GIF_SIDE", "log_video", "tensorboard_video_summary"]

GIF_SIDE = 512  # the longest side of the GIF TensorBoard gets


def tensorboard_video_summary(writer: Any, tag: str, gif: bytes):
    """The image summary holding the animated ``gif``, in the proto of ``writer``'s package
    (``torch.utils.tensorboard`` or ``tensorboardX``)."""
    from PIL import Image

    if type(writer).__module__.startswith("tensorboardX"):
        from tensorboardX.proto.summary_pb2 import Summary
    else:
        from tensorboard.compat.proto.summary_pb2 import Summary
    with Image.open(io.BytesIO(gif)) as image:
        width, height = image.size
    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=gif)
    return Summary(value=[Summary.Value(tag=tag, image=image)])


def log_video(accelerator: Any, tag: str, videos: Any, *, fps: float, step: int, mp4: Path, columns: int) -> None:
    """Log the grid of ``videos`` ``[N, F, 3, H, W]`` in [0, 1] (``grid_frames(videos, columns)``, already written
    to ``mp4``) to every TensorBoard and wandb tracker of ``accelerator`` at ``step``."""
    from flowalign.evaluation.videos import gif_bytes, grid_frames

    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            writer = tracker.writer
            gif = gif_bytes(grid_frames(videos, columns), fps, max_side=GIF_SIDE)
            writer._get_file_writer().add_summary(tensorboard_video_summary(writer, tag, gif), step)
            writer.flush()
        elif tracker.name == "wandb":
            import wandb

            tracker.log({tag: wandb.Video(str(mp4), format="mp4")}, step=step)
