"""The before/after report of a paired evaluation: ``before_after.md`` (per tag: before, after, the paired gain, its
standard error and z), ``before_after.json`` and the two captioned grids (videos as frame strips). The trainer's
end-of-run evaluation and ``flowalign eval toy-video --paired`` write it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from flowalign.evaluation.geneval import TAGS
from flowalign.evaluation.images import save_grid
from flowalign.evaluation.videos import strips_of
from flowalign.outputs import write_atomically

__all__ = ["write_before_after", "write_text_atomically"]

logger = logging.getLogger(__name__)


def write_text_atomically(path: Path, text: str) -> None:
    """``text`` to ``path`` through a temporary file renamed into place."""
    with write_atomically(path) as tmp:
        tmp.write_text(text)


def write_before_after(out: Path, before, after, before_summary, after_summary, paired, before_images, after_images,
                       *, seed: int | None = None, guidance_scale: float = 1.0,
                       rewards: dict[str, dict] | None = None) -> dict:
    """Write ``before_after.md`` / ``.json`` and the two grids; return the report (``seed`` and ``guidance_scale``: the
    evaluation's; ``rewards``: each of the run's rewards' paired statistics on the same samples, ``paired_difference``'s
    layout, a second table of their overall rows)."""
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| tag | before | after | paired gain | SE | z |", "|---|---|---|---|---|---|"]
    for tag in [t for t in TAGS if t in paired["tags"]] + ["overall"]:
        entry = paired["overall"] if tag == "overall" else paired["tags"][tag]
        lines.append(f"| {tag} | {entry['mean_a']:.3f} | {entry['mean_b']:.3f} | {entry['diff']:+.3f} | "
                     f"{entry['se']:.3f} | {entry['z']:.1f} |")
    if rewards:
        lines += ["", "| reward | before | after | paired gain | SE | z |", "|---|---|---|---|---|---|"]
        for name, entry in ((name, paired["overall"]) for name, paired in rewards.items()):
            lines.append(f"| {name} | {entry['mean_a']:.4g} | {entry['mean_b']:.4g} | {entry['diff']:+.4g} | "
                         f"{entry['se']:.2g} | {entry['z']:.1f} |")
    n = len(before)
    lines.append(f"\n{n} held-out samples, the same captions and seeds before and after (evaluation seed {seed}, "
                 f"guidance {guidance_scale:g}).")
    write_text_atomically(out / "before_after.md", "\n".join(lines) + "\n")
    report = {"paired": paired, "before": before_summary, "after": after_summary, "samples": n, "seed": seed,
              "guidance_scale": guidance_scale, "rewards": rewards or {}}
    write_text_atomically(out / "before_after.json", json.dumps(report, indent=1))
    for name, results, images in (("before", before, before_images), ("after", after, after_images)):
        if images.ndim == 5:  # videos [N, F, 3, H, W]: each as its frames side by side
            images = strips_of(images[:64])
        captions = [f"{r['prompt']} | {'yes' if r['correct'] else 'no'}" for r in results[:64]]
        save_grid(images[:64], captions, out / f"grid_{name}.png")
    logger.info("%s", "\n".join(lines))
    return report
