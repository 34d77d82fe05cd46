"""A sample video in the run's tracker (``train.tracker``): TensorBoard and Weights & Biases both take it.

* **TensorBoard**: an animated GIF in an image summary, the record ``SummaryWriter.add_video`` writes, built here
  without moviepy (which ``add_video`` needs to make the GIF and which flowalign does not install): the GIF comes
  from PIL (``flowalign.evaluation.videos.gif_bytes``) and goes through the writer's own event file. TensorBoard's
  Images tab plays it.
* **Weights & Biases**: ``wandb.Video`` of the mp4 the run already wrote (``samples/iteration-NNNNNN.mp4``); from
  a file, wandb needs no moviepy either (from an array it would).

Only the main process has trackers (accelerate's ``init_trackers``); other trackers are left alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["log_video", "tensorboard_video_summary"]


def tensorboard_video_summary(writer: Any, tag: str, video: Any, fps: float):
    """The image summary holding ``video`` ``[F, 3, H, W]`` as a GIF, in the proto of ``writer``'s package
    (``torch.utils.tensorboard`` or ``tensorboardX``)."""
    from flowalign.evaluation.videos import gif_bytes

    if type(writer).__module__.startswith("tensorboardX"):
        from tensorboardX.proto.summary_pb2 import Summary
    else:
        from tensorboard.compat.proto.summary_pb2 import Summary
    frames, channels, height, width = (int(n) for n in video.shape)
    image = Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=gif_bytes(video, fps))
    return Summary(value=[Summary.Value(tag=tag, image=image)])


def log_video(accelerator: Any, tag: str, video: Any, *, fps: float, step: int, mp4: Path) -> None:
    """Log ``video`` ``[F, 3, H, W]`` in [0, 1] (already written to ``mp4``) to every TensorBoard and wandb tracker
    of ``accelerator`` at ``step``."""
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            writer = tracker.writer
            writer._get_file_writer().add_summary(tensorboard_video_summary(writer, tag, video, fps), step)
            writer.flush()
        elif tracker.name == "wandb":
            import wandb

            tracker.log({tag: wandb.Video(str(mp4), format="mp4")}, step=step)
