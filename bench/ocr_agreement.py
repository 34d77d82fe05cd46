"""How well the ``ocr`` reward's engine (PP-OCRv4 from the rapidocr-onnxruntime wheel) reads text whose content is
known, and whether the toy SD3 model's samples can be read at all.

Rendered text: the quoted targets of the first ``--targets`` of Flow-GRPO's OCR test prompts
(``assets/prompts/ocr_test.txt``) are drawn black on white in DejaVu Sans (``flowalign.evaluation.rendered_text``) at
each font size of ``--sizes`` on ``--image``-pixel squares, wrapped at spaces to 90% of the width. Each image is read
by the engine and scored by Flow-GRPO's rule against its own prompt: a perfect reader scores 1 everywhere, so the
table measures the engine (and the rule's normalisation), not a model. Per size: the fraction of images scoring 1
(the target read in full: an exact read up to U+0020 spaces and case), the mean reward, the fraction with no line
detected, and the engine's seconds per image.

Toy model: ``--toy N`` samples the first N OCR test prompts with the toy world's SD3 model (``assets/toy-sd3``, its
own resolution, 10 ODE steps) and scores them the same way: its mean reward, exact fraction and how many samples the
engine finds any text in.

    OMP_NUM_THREADS=1 python bench/ocr_agreement.py [--targets 100] [--sizes 16 24 32 48 64] [--image 512]
                                                    [--toy 32] [--out bench/results/ocr_agreement]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def score(reward, images, prompts) -> list[dict]:
    """One record per image: what the engine read (joined as the rule joins it), its reward, the engine's time."""
    from flowalign.reward_models.ocr_rule import ocr_reward_from_lines

    records = []
    for image, prompt in zip(images, prompts):
        start, cpu = time.perf_counter(), time.process_time()
        (lines,) = reward.read(image[None])
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        read = None if lines is None else "".join(t for t, conf in lines if conf > 0)
        records.append({"prompt": prompt, "read": read, "lines": 0 if lines is None else len(lines),
                        "reward": ocr_reward_from_lines(prompt, lines), "seconds": seconds,
                        "cpu_seconds": cpu_seconds})
    return records


def summarise(records: list[dict]) -> dict:
    rewards = [r["reward"] for r in records]
    return {"n": len(records), "exact": sum(r == 1.0 for r in rewards) / len(rewards),
            "mean": statistics.fmean(rewards), "nothing_read": sum(r["lines"] == 0 for r in records) / len(records),
            "seconds_per_image": statistics.median(r["seconds"] for r in records),
            "cpu_seconds_per_image": statistics.median(r["cpu_seconds"] for r in records)}


def rendered(reward, prompts: list[str], sizes: list[int], image: int) -> dict:
    from flowalign.evaluation.rendered_text import render_text
    from flowalign.reward_models.ocr_rule import ocr_target

    results = {}
    for font_px in sizes:
        images = [render_text(ocr_target(p), size=image, font_px=font_px) for p in prompts]
        records = score(reward, images, prompts)
        results[font_px] = {"summary": summarise(records), "misreads": [
            {"target": ocr_target(r["prompt"]), "read": r["read"], "reward": r["reward"]}
            for r in records if r["reward"] < 1.0]}
        print(f"font {font_px:3d} px: {results[font_px]['summary']}", flush=True)
    return results


def toy(reward, prompts: list[str]) -> dict:
    from flowalign.evaluation.toy_eval import generate
    from flowalign.models import load_flow_model

    model = load_flow_model(str(REPO / "assets" / "toy-sd3"), device="cpu")
    images = generate(model, [{"prompt": p} for p in prompts], steps=10, images_per_prompt=1, batch_size=16,
                      progress=False)
    records = score(reward, images, prompts)
    summary = {**summarise(records), "resolution": list(images.shape[-2:])}
    print(f"toy model: {summary}", flush=True)
    return {"summary": summary, "reads": [r["read"] for r in records if r["lines"]]}


def markdown(report: dict) -> str:
    lines = [
        "# The OCR reward's engine on rendered text",
        "",
        f"Commit {report['commit']}, {report['machine']}; `python bench/ocr_agreement.py "
        f"--targets {report['targets']} --image {report['image']}` (rapidocr-onnxruntime "
        f"{report['rapidocr']}, onnxruntime {report['onnxruntime']}, one thread).",
        "",
        f"The quoted targets of the first {report['targets']} of Flow-GRPO's OCR test prompts, drawn black on white in "
        f"DejaVu Sans on {report['image']}x{report['image']} images, read by PP-OCRv4 (angle classifier off, text "
        "score 0.5) and scored by Flow-GRPO's rule against their own prompts. A perfect reader scores 1 on every "
        "image. Times are medians per image on one thread; the wall time is inflated by other jobs on the machine.",
        "",
        "| font size (px) | exact reads (reward 1) | mean reward | nothing read | CPU s / image | wall s / image |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for font_px, entry in report["rendered"].items():
        s = entry["summary"]
        lines.append(f"| {font_px} | {s['exact']:.3f} | {s['mean']:.4f} | {s['nothing_read']:.3f} | "
                     f"{s['cpu_seconds_per_image']:.2f} | {s['seconds_per_image']:.2f} |")
    sizes = list(report["rendered"])
    if sizes:
        misreads = report["rendered"][sizes[-1]]["misreads"]
        lines += ["", f"Misreads at {sizes[-1]} px ({len(misreads)}): "
                  + ("; ".join(f"`{m['target']}` read `{m['read']}` ({m['reward']:.3f})" for m in misreads[:12])
                     or "none") + "."]
    if report.get("toy"):
        s = report["toy"]["summary"]
        lines += ["", "## The toy SD3 model", "",
                  f"The first {s['n']} OCR test prompts sampled by `assets/toy-sd3` ({s['resolution'][0]}x"
                  f"{s['resolution'][1]} images, 10 ODE steps), read and scored the same way: mean reward "
                  f"{s['mean']:.4f}, exact reads {s['exact']:.3f}, no line detected in {s['nothing_read']:.3f} of "
                  f"them. Text the engine found: {report['toy']['reads'][:8] or 'none'}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", type=int, default=100)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 24, 32, 48, 64])
    parser.add_argument("--image", type=int, default=512)
    parser.add_argument("--toy", type=int, default=32, help="toy-model samples to read (0: skip)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "ocr_agreement"))
    args = parser.parse_args()

    import importlib.metadata

    from flowalign.data.prompts import load_prompts
    from flowalign.outputs import write_atomically
    from flowalign.reward_models.ocr import OcrReward

    torch.set_num_threads(1)
    prompts = [e["prompt"] for e in load_prompts(REPO / "assets" / "prompts" / "ocr_test.txt")]
    reward = OcrReward(threads=1)
    report = {"commit": commit(), "machine": f"{platform.machine()} CPU", "targets": args.targets,
              "image": args.image, "rapidocr": importlib.metadata.version("rapidocr-onnxruntime"),
              "onnxruntime": importlib.metadata.version("onnxruntime"),
              "rendered": rendered(reward, prompts[: args.targets], args.sizes, args.image)}
    if args.toy:
        report["toy"] = toy(reward, prompts[: args.toy])
    out = Path(args.out)
    with write_atomically(out.with_suffix(".json")) as tmp:
        tmp.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    with write_atomically(out.with_suffix(".md")) as tmp:
        tmp.write_text(markdown(report), encoding="utf-8")
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
