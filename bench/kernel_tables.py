"""Markdown tables of ``bench/kernel_speed.py``'s JSON reports, without torch (``bench/results_pages.py`` uses them too).

kernel_speed.py imports torch at once, so its formatters live here.
"""

from __future__ import annotations

SIZE_NAMES = {"sd35_512": "SD3.5 512", "flux_1024": "FLUX 1024"}
OP_NAMES = {"sde_step": "SDE step", "loss": "loss fwd+bwd"}


def check_table(rows: list[dict]) -> str:
    """The interpreter correctness check: the kernels' largest relative error against the torch reference."""
    lines = ["| latents | op | max relative error vs eager torch | ok |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['shape']} {tuple(row['latent'])} x5 | {row['op']} | {row['max_rel_error']:.2e} | "
                     f"{'yes' if row['ok'] else 'NO'} |")
    return "\n".join(lines)


def gpu_table(reports: list[dict]) -> str:
    """The timed rows of one or more GPU reports (one per latent dtype): median ms of each path, peak MiB above the
    inputs, the Triton op's speed-up and memory saving against eager torch, and whether the target is met."""
    lines = ["| latents | size | op | eager ms | torch.compile ms | triton ms | kernel ms | speed-up | eager MiB | "
             "triton MiB | memory saved | target |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for report in reports:
        for row in report["results"]:
            compiled = row.get("compile")
            compile_ms = "-" if compiled is None else "failed" if "ms" not in compiled else f"{compiled['ms']:.3f}"
            speed, memory = report["targets"][row["op"]]
            target = f"{speed:g}x" + ("" if memory is None else f", {memory:.0%}")
            lines.append(
                f"| {report['dtype']} | {SIZE_NAMES.get(row['size'], row['size'])} | {OP_NAMES.get(row['op'], row['op'])} "
                f"| {row['eager']['ms']:.3f} | {compile_ms} | {row['triton']['ms']:.3f} | {row['kernel']['ms']:.3f} "
                f"| {row['speedup_vs_eager']:.2f}x | {row['eager']['peak_mib']:.0f} | {row['triton']['peak_mib']:.0f} "
                f"| {row['memory_reduction_vs_eager']:.0%} | {target}: {'met' if row['meets_target'] else 'NOT met'} |")
    return "\n".join(lines)
