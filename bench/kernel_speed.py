"""The fused Triton kernels against eager torch and torch.compile of the same torch reference.

Two ops at two latent sizes, for a batch of 24 transitions: SD3.5 at 512 px (16x64x64 latents) and FLUX at 1024 px
(4096x64 packed tokens).
- ``sde_step``: one flow_grpo SDE step from given noise (mean, sample, mean-reduced log-prob).
- ``loss``: the per-transition GRPO loss with the latent-mean KL, forward and backward to ``dL/dv``.
Reports the median time and the peak memory above the inputs of each, as a table and JSON. The ratios are measured
in one run on one machine (docs/contributing/architecture.md#invariants).

On a machine without CUDA it runs only the correctness check of the kernels under Triton's interpreter (it restarts
itself with TRITON_INTERPRET=1) and writes that instead.

    python bench/kernel_speed.py [--repeats 50] [--dtype bf16] [--out bench/results/kernels.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from kernel_tables import check_table, gpu_table  # from this file's folder

# Not named kernels.py: this folder is on sys.path, and a top-level `kernels` module would shadow the Hugging Face
# `kernels` package transformers and diffusers import (docs/contributing/architecture.md#installed-names).
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIZES = {"sd35_512": (16, 64, 64), "flux_1024": (4096, 64)}
TARGETS = {"sde_step": (1.5, None), "loss": (2.0, 0.30)}  # (speed-up over eager, peak-memory reduction) issue #8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="dtype of latents and velocities")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--profile", action="store_true",
                        help="also print torch.profiler's table of the Triton loss (forward, backward), SD3.5 size")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/kernels[_check].json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":  # triton must see it before it is imported
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"})
        report = interpreter_check()
        out = Path(args.out or REPO / "bench/results/kernels_check.json")
    else:
        out = Path(args.out or REPO / "bench/results/kernels.json")
        report = gpu_benchmark(args, out)
        if args.profile:
            profile_loss(args)
    write_report(out, report)
    print(f"wrote {out}")


def write_report(out: Path, report: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


# ------------------------------------------------------------------------------------------------ the ops


def make_inputs(batch: int, shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """A batch of transitions at mixed steps (per-row sigmas), with a policy a little away from the old one."""
    from flowalign.kernels import sde_step_reference

    g = torch.Generator(device=device).manual_seed(seed)

    def normal(*size):
        return torch.randn(*size, generator=g, device=device)

    sigma = torch.linspace(0.95, 0.3, batch, device=device)
    rows = dict(sigma=sigma, sigma_next=sigma - 0.05, noise_level=torch.full((batch,), 0.7, device=device))
    x = normal(batch, *shape).to(dtype)
    v_old = normal(batch, *shape).to(dtype)
    noise = normal(batch, *shape)
    step = sde_step_reference(x, v_old, rows["sigma"], rows["sigma_next"], kind="flow_grpo",
                              noise_level=rows["noise_level"], noise=noise)
    v = (v_old.float() + 0.02 * normal(batch, *shape)).to(dtype)
    v_ref = (v_old.float() - 0.02 * normal(batch, *shape)).to(dtype)
    advantages = normal(batch).clamp(-5, 5)
    kernel_rows = (rows["sigma"], rows["sigma_next"], rows["noise_level"], torch.ones(batch, device=device))
    return dict(x=x, v=v, v_ref=v_ref, noise=noise, x_next=step.prev_sample, old_log_prob=step.log_prob,
                advantages=advantages, weights=torch.ones(batch, device=device), rows=kernel_rows, **rows)


def sde_op(backend: str | None, compiled: bool = False):
    from flowalign.kernels import sde_step_reference, sde_transition

    def reference(x, v, noise, sigma, sigma_next, noise_level):
        out = sde_step_reference(x, v, sigma, sigma_next, kind="flow_grpo", noise_level=noise_level, noise=noise)
        return out.prev_sample, out.mean, out.log_prob

    fn = torch.compile(reference) if compiled else reference

    def run(t):
        if backend == "kernel":
            from flowalign.kernels.sde_triton import sde_step_triton

            out = sde_step_triton(t["x"], t["v"], t["rows"], kind="flow_grpo", reduce="mean", noise=t["noise"])
            return out.prev_sample, out.mean, out.log_prob
        if backend == "triton":
            out = sde_transition(t["x"], t["v"], t["sigma"], t["sigma_next"], kind="flow_grpo",
                                 noise_level=t["noise_level"], noise=t["noise"], backend="triton")
            return out.prev_sample, out.mean, out.log_prob
        return fn(t["x"], t["v"], t["noise"], t["sigma"], t["sigma_next"], t["noise_level"])

    return run


def loss_op(backend: str | None, compiled: bool = False):
    """Forward and backward; returns the per-row loss, log-prob and dL/dv."""
    from flowalign.kernels import grpo_transition_loss, grpo_transition_loss_reference

    def reference(v, x, x_next, v_ref, sigma, sigma_next, noise_level, old_log_prob, advantages, weights):
        out = grpo_transition_loss_reference(v, x, x_next, sigma, sigma_next, old_log_prob, advantages,
                                             kind="flow_grpo", noise_level=noise_level, clip_range=1e-4,
                                             weights=weights, v_ref=v_ref, beta=0.01, kl="latent_mean")
        return out.loss, out.log_prob

    fn = torch.compile(reference) if compiled else reference

    def run(t):
        v = t["v"].detach().requires_grad_()
        if backend == "kernel":
            from flowalign.kernels.loss_triton import grpo_transition_loss_triton

            out = grpo_transition_loss_triton(v, t["x"], t["x_next"], t["v_ref"], t["rows"], t["old_log_prob"],
                                              t["advantages"], t["weights"], kind="flow_grpo", reduce="mean",
                                              clip_range=1e-4, beta=0.01, kl="latent_mean")
            loss, log_prob = out.loss, out.log_prob
        elif backend == "triton":
            out = grpo_transition_loss(v, t["x"], t["x_next"], t["sigma"], t["sigma_next"], t["old_log_prob"],
                                       t["advantages"], kind="flow_grpo", noise_level=t["noise_level"],
                                       clip_range=1e-4, weights=t["weights"], v_ref=t["v_ref"], beta=0.01,
                                       kl="latent_mean", backend="triton")
            loss, log_prob = out.loss, out.log_prob
        else:
            loss, log_prob = fn(v, t["x"], t["x_next"], t["v_ref"], t["sigma"], t["sigma_next"], t["noise_level"],
                                t["old_log_prob"], t["advantages"], t["weights"])
        loss.mean().backward()
        return loss.detach(), log_prob.detach(), v.grad

    return run


def max_error(out, ref) -> float:
    """The largest difference over the outputs, relative to each output's largest magnitude."""
    worst = 0.0
    for a, b in zip(out, ref):
        a, b = a.float(), b.float()
        worst = max(worst, float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12))
    return worst


# ------------------------------------------------------------------------------------------------ CPU: interpreter


def interpreter_check() -> dict:
    """Kernels vs eager references on small odd latents under the interpreter: relative max errors."""
    from flowalign.kernels import sde_triton

    assert sde_triton.INTERPRETED, "run with TRITON_INTERPRET=1 (the script restarts itself with it)"
    sde_triton.BLOCK = 64  # several chunks per row at these sizes
    shapes = {"sd35_like": (4, 9, 10), "flux_like": (45, 8)}
    rows = []
    for name, shape in shapes.items():
        inputs = make_inputs(5, shape, torch.float32, "cpu")
        for op_name, op in (("sde_step", sde_op), ("loss", loss_op)):
            error = max_error(op("triton")(inputs), op("torch")(inputs))
            rows.append({"shape": name, "latent": list(shape), "op": op_name, "max_rel_error": error,
                         "ok": error < 1e-4})
    print("CUDA is not available: Triton interpreter correctness check only (no timings).")
    print(check_table(rows))
    if not all(row["ok"] for row in rows):
        raise SystemExit("the kernels disagree with the torch reference")
    return {"device": "cpu (TRITON_INTERPRET=1)", "timed": False, "checks": rows}


# ------------------------------------------------------------------------------------------------ GPU: timings


def measure(run, inputs, repeats: int) -> tuple[float, float, object]:
    """Median milliseconds and peak MiB above what was allocated before the call; and the last result."""
    for _ in range(3):  # warm-up: compilation, autotuning, allocator
        result = run(inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del result
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = run(inputs)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return statistics.median(times), peak, result


def gpu_benchmark(args, out: Path) -> dict:
    """Time every op and size; the report is rewritten after each row, so a run cut short keeps what it measured."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    # triton: through flowalign.kernels' dispatch (input checks included), as the trainer calls it; kernel: the
    # launches alone, on inputs the dispatch already prepared (what the checks cost is the difference).
    impls = [("eager", None, False)] + ([] if args.no_compile else [("compile", None, True)]) + [
        ("triton", "triton", False), ("kernel", "kernel", False)]
    results = []
    report = {"device": torch.cuda.get_device_name(), "timed": True, "batch": args.batch, "dtype": args.dtype,
              "repeats": args.repeats, "torch": torch.__version__, "triton": triton_version(), "targets": TARGETS,
              "results": results}
    for size, shape in SIZES.items():
        inputs = make_inputs(args.batch, shape, dtype, "cuda")
        for op_name, op in (("sde_step", sde_op), ("loss", loss_op)):
            row = {"size": size, "latent": list(shape), "op": op_name}
            reference = None
            for impl, backend, compiled in impls:
                try:
                    ms, mib, result = measure(op(backend, compiled), inputs, args.repeats)
                except Exception as error:  # noqa: BLE001 -- torch.compile's own failures: report them, go on
                    if impl != "compile":
                        raise
                    row[impl] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
                    torch._dynamo.reset()
                    continue
                row[impl] = {"ms": ms, "peak_mib": mib}
                if impl == "eager":
                    reference = result
                else:
                    row[impl]["max_rel_error"] = max_error(result, reference)
                del result
            speed, memory = TARGETS[op_name]
            row["speedup_vs_eager"] = row["eager"]["ms"] / row["triton"]["ms"]
            row["memory_reduction_vs_eager"] = 1 - row["triton"]["peak_mib"] / max(row["eager"]["peak_mib"], 1e-9)
            row["meets_target"] = row["speedup_vs_eager"] >= speed and (
                memory is None or row["memory_reduction_vs_eager"] >= memory)
            results.append(row)
            write_report(out, report)
            torch.cuda.empty_cache()
    print(f"batch {args.batch}, {args.dtype} latents, median of {args.repeats}; peak = MiB above the inputs")
    print(gpu_table([report]))
    return report


def profile_loss(args) -> None:
    """Where a call of the fused loss spends its time, host and device (the ``kernel`` and ``triton`` columns)."""
    from torch.profiler import ProfilerActivity, profile

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    inputs = make_inputs(args.batch, SIZES["sd35_512"], dtype, "cuda")
    for backend in ("kernel", "triton"):
        run = loss_op(backend)
        for _ in range(3):
            run(inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                run(inputs)
            torch.cuda.synchronize()
        print(f"--- profile of 20 calls, {backend} path")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    main()
