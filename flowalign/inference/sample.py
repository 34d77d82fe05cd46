"""``flowalign sample``: reward-guided sampling of a flow model for a prompt file, under an NFE budget.

``run_guided(model, metadata, SampleConfig(...), reward=..., registers=...)`` turns a ``FlowModel`` and an image reward
into the plain callables of ``flowalign.samplers`` (``velocity(x, sigma, rows)``, ``reward(x0, rows)``), runs one
guidance method for every prompt, and returns the chosen latents, their rewards and the NFEs spent. ``run_sample``
adds loading, checks and outputs (``images/*.png``, ``grid.png``, ``results.json``, ``summary.md``).

Guidance methods (``--guidance``): ``none`` (one ODE sample), ``bon`` (best-of-N ODE samples), ``fk`` (Feynman-Kac
steering), ``dts`` (DTS*, greedy tree search; ``--dts-soft`` for DTS), ``rgs`` (reward-gradient guidance: on register
heads, ``--registers CKPT``, or on a differentiable image reward of the decoded ``x0_hat``, ``--rgs-reward NAME``, with
the gradient through the velocity or, ``--rgs-gradient x0``, on ``x0_hat`` alone at no NFE cost). The budget is per
prompt. Every check on the settings runs before the model loads.

A differentiable image reward is any registered reward with the entry point ``forward(images, prompts, metadata)``
(``flowalign.rewards``): the zoo's pickscore, hps, clipscore, aesthetic, imagereward, and toy_geneval_soft;
``--rgs-reward-kwargs`` gives its constructor arguments (local weights, device, dtype).

Classifier-free guidance (``--cfg SCALE``, every method): with ``SCALE > 1`` (on a model whose ``uses_cfg`` says so;
FLUX.1-dev's guidance embedding takes the scale in one pass) each velocity is
``v_uncond + SCALE (v_cond - v_uncond)`` with the negative prompt ``""``, as ``StableDiffusion3Pipeline`` does, and
costs 2 NFEs per sample (``evals_per_sample = 2``); a backward pass through such a velocity (RGS) costs 2 as well.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from flowalign.devices import resolve_device
from flowalign.samplers.guided import GUIDANCE, GuidedResult
from flowalign.samplers.rgs import DEFAULT_BANDS, check_bands
from flowalign.seeding import generator as seeded_generator

__all__ = ["RGS_GRADIENTS", "SampleConfig", "build_guide_reward", "encode_prompts", "latent_reward",
           "prompt_velocity", "run_guided", "run_sample"]

# Where RGS's gradient on a differentiable image reward is taken: through the velocity (one backward NFE per guided
# step, two with CFG) or on x0_hat alone (free); see samplers.rgs.x0_guide.
RGS_GRADIENTS = ("full", "x0")


@dataclass
class SampleConfig:
    """Settings of ``flowalign sample`` (per-prompt NFE ``budget``; see the module docstring). ``lora``: a trained
    LoRA (a checkpoint, with ``lora_weights`` ema/last, or a LoRA folder; ``flowalign.export``) on ``model``, which
    defaults to the checkpoint's base model, else ``assets/toy-sd3``."""

    model: str | None = None
    lora: str | None = None
    lora_weights: str | None = None
    prompts: str | None = None
    guidance: str = "bon"
    budget: int = 40
    steps: int = 10
    seed: int = 0
    reward: str = "toy_geneval"
    partial_credit: bool = True
    registers: str | None = None
    rgs_reward: str | None = None
    rgs_reward_kwargs: dict[str, Any] = field(default_factory=dict)
    rgs_gradient: str = "full"
    noise_level: float = 0.7
    lam: float = 10.0
    potential: str = "add"
    fk_resample_start: int = 0
    max_children: int = 3
    dts_soft: bool = False
    rgs_bands: list[tuple[float, float]] = field(default_factory=lambda: list(DEFAULT_BANDS))
    max_prompts: int | None = None
    batch_prompts: int = 16
    out_dir: str = "outputs/sample"
    device: str | None = None
    cfg: float = 1.0

    def evals_per_step(self, transformer_config: dict | None = None) -> int:
        """Transformer passes per sample and step: 2 with CFG (``cfg > 1``), unless the transformer's config says it
        takes the scale through a guidance embedding (FLUX.1-dev), as ``FlowModel.uses_cfg`` decides."""
        if not self.cfg > 1:
            return 1
        return 1 if (transformer_config or {}).get("guidance_embeds", False) else 2

    def validate(self, transformer_config: dict | None = None) -> None:
        """ValueError naming the first bad setting; cheap (no model is loaded). With ``transformer_config`` (the
        model's ``transformer/config.json``, when local) the budget check counts CFG's second pass; without it, only
        the steps (the sampler checks the exact cost again once the model is loaded)."""
        if self.guidance not in GUIDANCE:
            raise ValueError(f"unknown guidance {self.guidance!r}: expected one of {', '.join(GUIDANCE)}")
        for name in ("budget", "steps", "batch_prompts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        number = isinstance(self.cfg, (int, float)) and not isinstance(self.cfg, bool)
        if not (number and math.isfinite(self.cfg) and self.cfg >= 1):
            raise ValueError(f"cfg must be a finite number >= 1 (the classifier-free guidance scale; 1 = off), got "
                             f"{self.cfg!r}")
        per_trajectory = self.steps * (1 if transformer_config is None else self.evals_per_step(transformer_config))
        if self.guidance != "none" and self.budget < per_trajectory:
            cost = f"{self.steps} NFEs" if per_trajectory == self.steps else f"{per_trajectory} NFEs with --cfg"
            raise ValueError(
                f"budget={self.budget} NFEs per prompt is smaller than one trajectory of {self.steps} steps "
                f"({cost}): raise --budget to at least {per_trajectory} or lower --steps"
            )
        if self.guidance == "rgs" and self.registers is None and self.rgs_reward is None:
            raise ValueError(
                "guidance 'rgs' needs a differentiable reward, and the image reward "
                f"{self.reward!r} is not (it scores decoded images without gradients): pass --registers CKPT "
                "(trained with `flowalign registers train`), or --rgs-reward NAME with a differentiable image reward "
                "(toy_geneval_soft, pickscore, hps, clipscore, aesthetic, imagereward), or use --guidance bon|fk|dts"
            )
        if not isinstance(self.rgs_reward_kwargs, dict):
            raise ValueError(f"rgs_reward_kwargs must be a dict of the reward's constructor arguments, got "
                             f"{self.rgs_reward_kwargs!r}")
        if self.rgs_reward_kwargs and self.rgs_reward is None:
            raise ValueError("--rgs-reward-kwargs are the constructor arguments of --rgs-reward: pass --rgs-reward "
                             "NAME too")
        if self.registers is not None and self.rgs_reward is not None:
            raise ValueError("pass either --registers or --rgs-reward as RGS's gradient source, not both")
        if self.rgs_gradient not in RGS_GRADIENTS:
            raise ValueError(f"rgs_gradient must be one of {', '.join(RGS_GRADIENTS)}, got {self.rgs_gradient!r}")
        if self.rgs_gradient != "full" and self.rgs_reward is None:
            raise ValueError(f"rgs_gradient {self.rgs_gradient!r} applies to --rgs-reward only (register heads read "
                             "x_t itself, so their gradient always runs through the transformer)")
        if self.rgs_reward is not None and self.guidance not in ("rgs", "fk"):
            raise ValueError(f"--rgs-reward guides --guidance rgs (and FK's proposals), not {self.guidance!r}")
        if self.rgs_reward is not None and self.guidance == "fk" and self.rgs_gradient != "x0":
            raise ValueError("FK's RGS-guided proposals take the gradient on x0_hat only (no extra NFE): pass "
                             "--rgs-gradient x0 with --guidance fk --rgs-reward")
        if self.guidance in ("fk", "dts") and not self.noise_level > 0:
            raise ValueError(f"guidance {self.guidance!r} needs noise_level > 0 (SDE particles), got {self.noise_level}")
        if not (isinstance(self.fk_resample_start, int) and 0 <= self.fk_resample_start < self.steps - 1):
            raise ValueError(f"fk_resample_start must be a step in 0..{self.steps - 2} (FK scores x0_hat from that "
                             f"step on, every step but the last), got {self.fk_resample_start!r}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"max_prompts must be >= 1 (or None for all), got {self.max_prompts!r}")
        if self.lora_weights is not None and self.lora is None:
            raise ValueError(f"--weights {self.lora_weights} chooses a checkpoint's weights: give the checkpoint "
                             "with --lora CHECKPOINT")
        check_bands(self.rgs_bands)


def latent_reward(model, reward_fn, prompts: Sequence[str], metadata: Sequence[dict], *, chunk: int = 64,
                  differentiable: bool = False):
    """``reward(x0, rows) -> [n]``: decode latents and score them with an image reward for prompts ``rows``.

    By default scored without gradients, float64 on the CPU (``differentiable = False``). With ``differentiable``
    (for an image reward with the entry point ``forward(images, prompts, metadata)``, refused here otherwise),
    decoding and scoring go through ``flowalign.rewards.differentiable_score`` and keep the autograd graph, so
    ``d reward / d x0`` flows back through the VAE decoder; scores are float32 on the latents' device.
    """
    from flowalign.rewards import differentiable_score, require_differentiable

    if differentiable:
        require_differentiable(reward_fn, "reward")

    def reward(x0: Tensor, rows: Tensor) -> Tensor:
        scores = []
        for start in range(0, x0.shape[0], chunk):
            part = rows[start : start + chunk].tolist()
            images = model.decode(x0[start : start + chunk])
            texts, entries = [prompts[r] for r in part], [metadata[r] for r in part]
            if differentiable:
                scores.append(differentiable_score(reward_fn, images, texts, entries).to(x0.device))
            else:
                out = reward_fn(images, texts, entries)
                scores.append(torch.as_tensor(out, dtype=torch.float64).flatten().cpu())
        return torch.cat(scores)

    reward.differentiable = differentiable
    reward.name = getattr(reward_fn, "name", "reward")
    return reward if differentiable else torch.no_grad()(reward)


def prompt_velocity(model, cond, guidance_scale: float = 1.0):
    """``velocity(x, sigma, rows)`` with prompt ``rows[i]``'s conditioning for row ``i``, at ``guidance_scale``
    (classifier-free guidance when ``model.uses_cfg(guidance_scale)``: ``cond`` then needs its negative embeddings,
    and each call costs 2 NFEs per row, ``evals_per_sample = 2``, as ``FlowModel.velocity_fn``)."""

    def velocity(x: Tensor, sigma: Tensor, rows: Tensor) -> Tensor:
        return model.velocity(x, sigma, cond.index(rows), guidance_scale)

    velocity.evals_per_sample = 2 if model.uses_cfg(guidance_scale) else 1
    return velocity


def encode_prompts(model, prompts: Sequence[str], guidance_scale: float = 1.0):
    """``model.encode(prompts)``, with the empty negative prompt of every row when the scale means CFG (as the
    trainer and ``StableDiffusion3Pipeline`` with no ``negative_prompt``)."""
    negatives = [""] * len(prompts) if model.uses_cfg(guidance_scale) else None
    return model.encode(list(prompts), negative_prompts=negatives)


def run_guided(model, metadata: Sequence[dict], config: SampleConfig, *, reward_fn, registers=None,
               guide_reward=None, prompt_offset: int = 0) -> GuidedResult:
    """One guidance method over ``metadata`` (one batch of prompts). Prompt ``p``'s randomness comes from the
    generator keyed ``(seed, prompt_offset + p)``. RGS takes its gradient from ``registers`` or from the
    differentiable image reward ``guide_reward``."""
    from flowalign.samplers.dts import diffusion_tree_search
    from flowalign.samplers.fk import fk_steering
    from flowalign.samplers.guided import best_of_n
    from flowalign.samplers.rgs import reward_guided_sampling

    prompts = [entry["prompt"] for entry in metadata]
    cond = encode_prompts(model, prompts, config.cfg)
    velocity = prompt_velocity(model, cond, config.cfg)
    evals = velocity.evals_per_sample
    reward = latent_reward(model, reward_fn, prompts, metadata)
    sigmas = model.sigmas(config.steps)
    shape = model.latent_shape(1)[1:]
    generators = [seeded_generator(config.seed, prompt_offset + p) for p in range(len(prompts))]
    common = dict(device=model.device)
    g = config.guidance
    if g == "none":  # one trajectory: the budget is what it costs
        return best_of_n(velocity, reward, sigmas, shape, generators, config.steps * evals, **common)
    if g == "bon":
        return best_of_n(velocity, reward, sigmas, shape, generators, config.budget, **common)
    guide_latent = None if guide_reward is None else latent_reward(model, guide_reward, prompts, metadata,
                                                                    differentiable=True)
    if g == "fk":
        corrector = None
        if guide_latent is not None:  # RGS-guided proposals
            from flowalign.samplers.rgs import x0_gradient_correction

            corrector = x0_gradient_correction(guide_latent, config.rgs_bands)
        return fk_steering(velocity, reward, sigmas, shape, generators, config.budget, potential_kind=config.potential,
                           lam=config.lam, noise_level=config.noise_level, corrector=corrector,
                           resample_steps=range(config.fk_resample_start, config.steps - 1), **common)
    if g == "dts":
        return diffusion_tree_search(velocity, reward, sigmas, shape, generators, config.budget,
                                     greedy=not config.dts_soft, lam=config.lam, max_children=config.max_children,
                                     noise_level=config.noise_level, **common)
    if guide_latent is not None:
        from flowalign.samplers.rgs import x0_guide

        through = config.rgs_gradient == "full"
        guide = x0_guide(velocity, guide_latent, through_velocity=through)
        # a backward pass through the velocity costs what its forward did: 2 NFEs per sample with CFG
        return reward_guided_sampling(guide, sigmas, shape, generators, config.budget, final_reward=reward,
                                      bands=config.rgs_bands, backward_nfe=evals if through else 0, **common)
    if registers is None:
        raise ValueError("guidance 'rgs' needs a differentiable reward: pass registers= or guide_reward=")
    registers.attach(model.transformer)
    try:
        return reward_guided_sampling(registers.guide(velocity), sigmas, shape, generators, config.budget,
                                      head_weights=[1.0] * len(registers.head_names), final_reward=reward,
                                      bands=config.rgs_bands, backward_nfe=evals, **common)
    finally:
        registers.detach()


def build_guide_reward(name: str, **kwargs: Any):
    """The registered image reward ``name`` (built with ``kwargs``) as RGS's gradient source; ValueError naming
    ``--rgs-reward`` unless it has the differentiable entry point ``forward``, checked on its class before it is
    built (``flowalign.rewards.build_differentiable_reward``)."""
    from flowalign.rewards import build_differentiable_reward

    return build_differentiable_reward(name, "--rgs-reward", **kwargs)


def read_transformer_config(model_path: str) -> dict | None:
    """``<model>/transformer/config.json`` of a local pipeline directory, or None (a hub id)."""
    path = Path(model_path) / "transformer" / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def run_sample(config: SampleConfig) -> dict:
    """Check, load, sample every prompt and write the outputs; returns the summary written to results.json."""
    from dataclasses import replace

    from flowalign.evaluation.geneval import load_metadata
    from flowalign.evaluation.toy_eval import DEFAULT_MODEL, default_prompts_path
    from flowalign.errors import setup_phase
    from flowalign.export import base_model_path, load_model, resolve_lora

    with setup_phase():  # the user's mistakes, up to a loaded model, are reported as such (exit 2 on the CLI)
        config.validate()
        if config.rgs_reward is not None:  # a reward without a gradient is refused before anything is built or loaded
            from flowalign.rewards import require_differentiable_reward

            require_differentiable_reward(config.rgs_reward, "--rgs-reward")
        lora = resolve_lora(config.lora, config.lora_weights) if config.lora is not None else None
        model_path = base_model_path(config.model, lora, DEFAULT_MODEL)
        config = replace(config, model=model_path, lora_weights=None if lora is None else lora.weights)
        config.validate(read_transformer_config(model_path))  # the budget under CFG, exactly, before the model loads
        guide_reward = None
        if config.rgs_reward is not None:
            guide_reward = build_guide_reward(config.rgs_reward, **config.rgs_reward_kwargs)
        metadata = load_metadata(config.prompts or default_prompts_path())
        if config.max_prompts is not None:
            metadata = metadata[: config.max_prompts]
        if not metadata:
            raise ValueError(f"no prompts in {config.prompts}")
        registers = None
        if config.registers is not None:
            from flowalign.reward_models.registers import load_registers, read_checkpoint, check_transformer_config

            saved = read_checkpoint(config.registers)["transformer_config"]
            actual = read_transformer_config(model_path)
            if actual is not None:  # before the model loads
                check_transformer_config(saved, actual, f"register checkpoint {config.registers}")
        from flowalign.rewards import build_reward

        reward_kwargs = {"partial_credit": config.partial_credit} if config.reward == "toy_geneval" else {}
        reward_fn = build_reward(config.reward, **reward_kwargs)
        device = str(resolve_device(config.device))
        model = load_model(model_path, lora, device=device)
    model.transformer.requires_grad_(False)
    if config.registers is not None:
        registers = load_registers(config.registers, dict(model.transformer.config)).to(device)

    images, rewards, nfes = sample_prompts(model, metadata, config, reward_fn=reward_fn, registers=registers,
                                           guide_reward=guide_reward)
    return write_outputs(config, metadata, images, rewards, nfes)


def sample_prompts(model, metadata, config, *, reward_fn, registers=None,
                   guide_reward=None) -> tuple[Tensor, Tensor, Tensor]:
    """``run_guided`` over the prompts, ``config.batch_prompts`` at a time: decoded images ``[P, 3, H, W]`` on the CPU,
    the chosen samples' rewards ``[P]`` and the NFEs each prompt used ``[P]``."""
    finals, rewards, nfes = [], [], []
    for start in range(0, len(metadata), config.batch_prompts):
        batch = metadata[start : start + config.batch_prompts]
        result = run_guided(model, batch, config, reward_fn=reward_fn, registers=registers,
                            guide_reward=guide_reward, prompt_offset=start)
        finals.append(result.final.detach())
        rewards.append(result.reward)
        nfes.append(result.nfe)
    with torch.no_grad():
        images = torch.cat([model.decode(f) for f in finals]).cpu()
    return images, torch.cat(rewards), torch.cat(nfes)


def write_outputs(config: SampleConfig, metadata: Sequence[dict], images: Tensor, rewards: Tensor,
                  nfes: Tensor) -> dict:
    from flowalign.evaluation.images import save_grid, to_uint8

    out = Path(config.out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    from PIL import Image

    for index, pixels in enumerate(to_uint8(images)):
        Image.fromarray(pixels).save(out / "images" / f"{index:04d}.png")
    save_grid(images[:64], [m["prompt"] for m in metadata[:64]], out / "grid.png")
    rows = [{"prompt_id": p, "prompt": m["prompt"], "tag": m.get("tag"), "reward": _num(r), "nfe": int(n)}
            for p, (m, r, n) in enumerate(zip(metadata, rewards.tolist(), nfes.tolist()))]
    summary: dict[str, Any] = {
        "config": asdict(config),
        "prompts": len(rows),
        "mean_reward": _num(float(torch.nanmean(rewards.double()))) if len(rows) else None,
        "mean_nfe": float(nfes.double().mean()),
        "max_nfe": int(nfes.max()),
    }
    if all("include" in m for m in metadata):
        from flowalign.evaluation.geneval import summarize
        from flowalign.toy.reward import ToyGenEvalReward

        correct = ToyGenEvalReward()(images, [m["prompt"] for m in metadata], list(metadata))
        for row, value in zip(rows, correct.tolist()):
            row["correct"] = bool(value)
        summary["geneval"] = summarize(rows)
    summary["results"] = rows
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# flowalign sample: guidance {config.guidance}, budget {config.budget} NFEs/prompt, cfg {config.cfg:g}",
             "",
             f"prompts {len(rows)}, mean reward {summary['mean_reward']}, mean NFEs {summary['mean_nfe']:.1f}"]
    if "geneval" in summary:
        lines.append(f"toy GenEval overall {summary['geneval']['overall']:.3f}")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return summary


def _num(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)
