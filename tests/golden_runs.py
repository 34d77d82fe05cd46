"""The golden runs: every method preset and both model presets, 2 iterations each in one CPU thread, reduced to
what a change of the trainer's math would move.

A run is summarised by the sha256 of its trainable weights, its EMA, its optimizer state and its ``metrics.jsonl``
without timing keys and without the collapse metrics (``digests``), and by the values the tolerance check reads
(``values``): the weight and EMA *updates* (final minus initial), and the metrics. The collapse metrics
(``collapse/*``, ``flowalign.training.collapse``) are measurements of the samples, not training state: computed
without gradients or randomness, they feed nothing back, so they are left out like the timings, and a change of what
they measure (a new embedding, another held-out reward) moves no golden digest. ``tests/test_collapse.py`` pins their
values and checks that turning them off leaves every other metric and weight bitwise unchanged.

Floats are not the same on every CPU (``torch`` picks kernels by CPU capability and the BLAS differs), and RL
amplifies the difference, so the recorded file (``tests/golden/baselines.json``) keys the digests by a fingerprint of
the platform. Where the fingerprint matches, the test compares digests exactly. Where it does not, it compares
values against the recorded reference run with tolerances (``compare_values``), chosen as follows:

* Counts (NFEs, skipped updates, invalid rewards), the learning rate and the first micro-batch's ratio of exactly 1
  (with its approx-KL and clip fraction of 0) are exact on any machine.
* Iteration 0's rewards come from the untrained model, through forward passes only: float rounding moves them by
  about 1e-7 to 1e-4 relative (ten SDE steps through the transformer), so they must agree to 1e-3. Their standard
  deviation moves by at most as much as the rewards themselves do, so ``reward_std`` is held to the rewards'
  tolerance, 1e-3 of the mean reward, not to 1e-3 of itself: a group's spread of a few 1e-4 on a reward near 0.5
  moves by a few percent of itself between CPUs with AVX2 and AVX512 kernels (measured on the tiny FLUX, SD3.5,
  Z-Image, Qwen-Image and Kontext presets).
* The weights are compared by their update over the run, not elementwise. Adam's first step is ``lr * sign(g)``
  for every element, so on a gradient that is zero up to rounding the sign (and an ``lr``-sized step) may flip from
  one CPU to another. Such elements are few, so the updates must point the same way (cosine >= 0.99: about 0.5% of
  the elements flipped) and have the same size (norm within 2%), while a real change of the math (another
  advantage, loss, clip, step selection or learning rate) turns or scales the whole update.
* Iteration 1's rewards (after an update) agree within 5% relative or 5e-3 absolute. Losses, KL, clip fractions
  and gradient norms are not compared: they drive the weights, which are.

Re-recording is a reviewed change, never a way to make a red test green: run
``FLOWALIGN_GOLDEN=record python -m pytest tests/test_golden.py`` to write this platform's digests (keeping the
reference values), or ``FLOWALIGN_GOLDEN=reference`` to also replace the reference values, then read
``git diff tests/golden`` and say in the commit which runs moved and why.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
BASELINES = GOLDEN / "baselines.json"
METHODS = sorted((REPO / "configs/methods").glob("*.yaml"))


def is_video_preset(path: Path) -> bool:
    """Whether the model preset at ``path`` names a video family: those train once video rewards exist (issue #43),
    so they are not golden runs yet."""
    import yaml

    from flowalign.models import MODEL_FAMILIES

    family = (yaml.safe_load(path.read_text()).get("model") or {}).get("family")
    return family in MODEL_FAMILIES and MODEL_FAMILIES.get(family).modality == "video"


MODELS = [p for p in sorted((REPO / "configs/models").glob("*.yaml")) if not is_video_preset(p)]
# Every method preset and every image model preset (each on the tiny pipeline of its family: tests/test_golden.py).
RUNS = [p.stem for p in METHODS] + [p.stem for p in MODELS]

# Metrics that are the same on any machine; metrics read for iteration 0 at a tight tolerance.
EXACT_METRICS = ("iteration", "nfe", "nfe/rollout", "nfe/completion", "nfe/objectives", "skipped", "reward_invalid",
                 "lr", "first_ratio_max", "first_ratio_mean", "first_approx_kl", "first_clip_frac")
FORWARD_ONLY_METRICS = ("reward", "reward_std")
# Metrics no digest or value holds: wall-clock timings, and the collapse metrics (measurements; module docstring).
UNPINNED_METRICS = ("time/", "collapse/")
COSINE_MIN, NORM_RATIO_TOLERANCE = 0.99, 0.02
LATE_RTOL, LATE_ATOL, FORWARD_RTOL = 0.05, 5e-3, 1e-3


def fingerprint() -> str:
    """The platform a digest holds on: torch (and the model libraries) versions, CPU capability and model."""
    import diffusers
    import peft

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [f"torch {torch.__version__}", f"diffusers {diffusers.__version__}", f"peft {peft.__version__}",
             f"cpu {torch.backends.cpu.get_cpu_capability()}", cpu]
    return " | ".join(parts)


# Every golden run computes in float32, the model presets that publish bf16 included: bf16 rounds ~1e-3 relative and
# differently under each CPU's kernels, and the group advantages (a reward spread of ~2e-3 on the tiny models) turn
# that into another update. Measured on the sd35_medium run, AVX2 against the `default` kernels
# (ATEN_CPU_CAPABILITY): update cosine 0.785 in bf16, 0.99999999999 in float32. The golden runs pin the trainer's math;
# the bf16 paths are tested where they are the point (tests/test_presets.py, tests/test_fsdp2.py).
FLOAT32 = {"model.dtype": "fp32", "model.mixed_precision": "no"}

# Rollout sizes that fit each preset's shape in a small run: a tree's leaves are its group, a probed trunk's chunk
# holds all of a prompt's probe groups; the objective-only presets train on 2 units of 1 pair; the tiny FLUX runs
# without gradient checkpointing.
SMALL_RUN_SHAPE = {
    "branch_grpo": {"data.group_size": 16, "sampling.batch_size": 16},
    "tempflow_grpo": {"sampling.batch_size": 8},
    "euphonium": {"credit.process_reward": "brightness"},  # a differentiable process reward that needs no segmenter
    "soar": {"objectives.soar.batch_size": 1, "objectives.soar.units_per_iteration": 2},
    "sft": {"objectives.flow_matching.batch_size": 1, "objectives.flow_matching.units_per_iteration": 2},
    "drl_adjoint": {"objectives.adjoint_matching.batch_size": 1, "objectives.adjoint_matching.units_per_iteration": 2},
    # GARDO ranks its proxy against auxiliary rewards that need no segmenter: brightness against JPEG (in)compressibility
    "gardo": {"reward.rewards": "[{name: brightness}, {name: jpeg_compressibility, weight: 0.0}, "
                                "{name: jpeg_incompressibility, weight: 0.0}]",
              "loss.gated_kl.auxiliaries": "[jpeg_compressibility, jpeg_incompressibility]"},
    # Pref-GRPO's win rate from the stand-in judge on brightness (no segmenter), beside a second brightness reward
    "pref_grpo": {"reward.rewards": "[{name: pairwise_preference, weight: 0.4, kwargs: {judge: score, judge_kwargs: "
                                    "{reward: brightness}}}, {name: brightness, weight: 0.6, kwargs: {channel: 0}}]"},
}


def small_run_values(model_path: Path, out: Path) -> dict:
    """A preset's small run (tiny model, brightness reward, 2 prompts x 2 samples at 32 px, 2 iterations), shared
    by the golden runs and tests/test_presets.py."""
    return {
        "model.path": str(model_path), "model.lora_rank": 4, "model.lora_alpha": 8,
        "reward.rewards": "[{name: brightness}]",
        "data.train_prompts": str(REPO / "assets/prompts/train.jsonl"), "data.prompts_per_iteration": 2,
        "data.group_size": 2, "sampling.image_size": 32, "sampling.batch_size": 2, "train.iterations": 2,
        "train.tracker": "none", "train.eval_at_end": "false", "train.sample_every": 0, "train.out_dir": str(out),
    }


def run_settings(name: str, model_path: Path, out: Path) -> list[str]:
    """The golden run of a preset: its small run, with the preset's shape, and only the final checkpoint."""
    values = {**small_run_values(model_path, out), "train.checkpoint_every": 0, **SMALL_RUN_SHAPE.get(name, {}),
              **FLOAT32}
    if name == "flux_dev":
        values["model.gradient_checkpointing"] = "false"
    return [f"{k}={v}" for k, v in values.items()]


@contextmanager
def torch_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def preset_path(name: str) -> Path:
    return next(p for p in METHODS + MODELS if p.stem == name)


def run_golden(name: str, model_path: Path, out: Path, *, extra: dict | None = None, registers: Path | None = None,
               threads: int = 1):
    """Train preset ``name`` for 2 iterations in one thread (or ``threads``); returns ``(digests, values)``."""
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    settings = run_settings(name, model_path, out) + [f"{k}={v}" for k, v in (extra or {}).items()]
    if registers is not None:
        settings.append(f"credit.registers={registers}")
    with torch_threads(threads):
        trainer = Trainer(load_config(TrainConfig, preset_path(name), settings))
        initial = {n: p.detach().clone() for n, p in trainer.trainable_state().items()}
        trainer.train()
    weights = {n: p.detach().cpu() for n, p in trainer.trainable_state().items()}
    ema = None if trainer.ema is None else {n: e.detach().cpu() for n, e in trainer.ema.state_dict().items()}
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith(UNPINNED_METRICS)}
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    digests = {
        "weights": _tensors_digest(weights),
        "ema": None if ema is None else _tensors_digest(ema),
        "optimizer": _optimizer_digest(optimizer.state_dict()),
        "metrics": hashlib.sha256(json.dumps(metrics, sort_keys=True).encode()).hexdigest(),
    }
    values = {
        "weights": {n: weights[n] - initial[n].cpu() for n in weights},
        "ema": None if ema is None else {n: ema[n] - initial[n].cpu() for n in ema},
        "metrics": metrics,
    }
    return digests, values


def _tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensors[name].shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _optimizer_digest(state_dict: dict) -> str:
    tensors = {}
    for index, state in state_dict["state"].items():
        for key, value in state.items():
            tensors[f"{index}.{key}"] = torch.as_tensor(value)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]]
    return hashlib.sha256((_tensors_digest(tensors) + json.dumps(groups, sort_keys=True, default=str)).encode()
                          ).hexdigest()


# ------------------------------------------------------------------------------------------------ the record


def load_baselines() -> dict:
    return json.loads(BASELINES.read_text()) if BASELINES.is_file() else {"digests": {}, "reference": None}


def save_reference(name: str, values: dict) -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    tensors = {f"weights/{k}": v.contiguous() for k, v in values["weights"].items()}
    if values["ema"] is not None:
        tensors.update({f"ema/{k}": v.contiguous() for k, v in values["ema"].items()})
    save_file(tensors, str(GOLDEN / f"{name}.safetensors"))
    (GOLDEN / f"{name}.metrics.json").write_text(json.dumps(values["metrics"], indent=0, sort_keys=True) + "\n")


def load_reference(name: str) -> dict:
    tensors = load_file(str(GOLDEN / f"{name}.safetensors"))
    weights = {k.removeprefix("weights/"): v for k, v in tensors.items() if k.startswith("weights/")}
    ema = {k.removeprefix("ema/"): v for k, v in tensors.items() if k.startswith("ema/")} or None
    return {"weights": weights, "ema": ema,
            "metrics": json.loads((GOLDEN / f"{name}.metrics.json").read_text())}


def record(name: str, digests: dict, values: dict, *, reference: bool) -> None:
    baselines = load_baselines()
    baselines["digests"].setdefault(fingerprint(), {})[name] = digests
    if reference or not (GOLDEN / f"{name}.safetensors").is_file():
        save_reference(name, values)
        baselines["reference"][name] = fingerprint()  # the platform each run's reference values come from
    GOLDEN.mkdir(parents=True, exist_ok=True)
    BASELINES.write_text(json.dumps(baselines, indent=1, sort_keys=True) + "\n")


def mode() -> str:
    """``check`` (the default), ``record`` (this platform's digests) or ``reference`` (digests and values)."""
    value = os.environ.get("FLOWALIGN_GOLDEN", "check")
    if value not in ("check", "record", "reference"):
        raise ValueError(f"FLOWALIGN_GOLDEN must be check, record or reference, got {value!r}")
    return value


# ------------------------------------------------------------------------------------------------ the checks


def compare_digests(got: dict, recorded: dict) -> list[str]:
    """The parts whose digest moved."""
    return [part for part in ("weights", "ema", "optimizer", "metrics") if got[part] != recorded[part]]


def _update_agreement(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, float]:
    """``(cosine, norm ratio)`` of two updates, all tensors flattened into one vector."""
    names = sorted(ref)
    a = torch.cat([got[n].double().flatten() for n in names])
    b = torch.cat([ref[n].double().flatten() for n in names])
    norm_a, norm_b = a.norm().item(), b.norm().item()
    if norm_b == 0:
        return (1.0 if norm_a == 0 else 0.0), (1.0 if norm_a == 0 else math.inf)
    return float(a @ b) / max(norm_a * norm_b, 1e-300), norm_a / norm_b


def compare_values(got: dict, ref: dict) -> list[str]:
    """What differs beyond the tolerances of the module docstring; empty when the run agrees."""
    problems = []
    for part in ("weights", "ema"):
        if (got[part] is None) != (ref[part] is None):
            problems.append(f"{part}: present in only one run")
            continue
        if got[part] is None:
            continue
        if set(got[part]) != set(ref[part]):
            problems.append(f"{part}: different tensors")
            continue
        cosine, ratio = _update_agreement(got[part], ref[part])
        if cosine < COSINE_MIN or abs(ratio - 1) > NORM_RATIO_TOLERANCE:
            problems.append(f"{part}: update cosine {cosine:.4f} (>= {COSINE_MIN}), norm ratio {ratio:.4f} "
                            f"(1 ± {NORM_RATIO_TOLERANCE})")
    if len(got["metrics"]) != len(ref["metrics"]):
        return problems + [f"metrics: {len(got['metrics'])} iterations, recorded {len(ref['metrics'])}"]
    for iteration, (a, b) in enumerate(zip(got["metrics"], ref["metrics"])):
        if set(a) != set(b):
            problems.append(f"metrics[{iteration}]: keys differ: {sorted(set(a) ^ set(b))}")
            continue
        for key in sorted(a):
            x, y = a[key], b[key]
            if key in EXACT_METRICS:
                ok = x == y
            elif key in FORWARD_ONLY_METRICS or key.startswith("rewards/"):
                rtol, atol = (FORWARD_RTOL, 1e-6) if iteration == 0 else (LATE_RTOL, LATE_ATOL)
                if key == "reward_std":  # moves by at most what the rewards move: their tolerance, absolute
                    atol = max(atol, rtol * abs(b["reward"]))
                ok = _same_number(x, y, rtol, atol)
            else:
                continue  # losses, KL, clip fractions, gradient norms: the weights' check covers what they drive
            if not ok:
                problems.append(f"metrics[{iteration}].{key}: {x!r} vs recorded {y!r}")
    return problems


def _same_number(x, y, rtol: float, atol: float) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return math.isclose(x, y, rel_tol=rtol, abs_tol=atol)
