"""``flowalign sample``: reward-guided sampling of a flow model for a prompt file, under an NFE budget.

``run_guided(model, metadata, SampleConfig(...), reward_fn=..., registers=..., guide_reward=...)`` turns a
``FlowModel`` and an image reward into the plain callables of ``flowalign.samplers`` (``velocity(x, sigma, rows)``,
``reward(x0, rows)``), runs the configured guided sampler (a registered ``GuidedSampler``, ``flowalign.inference``)
for every prompt, and returns its ``GuidedResult``: the chosen latents (or a set per prompt), their rewards and the
NFEs spent. ``run_sample`` adds loading, checks and outputs (``images/*.png``, ``grid.png``, ``results.json``,
``summary.md``).

The sampler is the component section ``sampler`` (``--guidance NAME``, its settings ``sampler.KEY`` or their options:
``--lam``, ``--potential``, ``--fk-resampling``, ``--fk-adaptive``, ``--fk-resample-start``, ``--fk-resample-every``,
``--fk-resample-end``, ``--fk-reward-min-value``, ``--noise-level``, ``--max-children``, ``--dts-soft``,
``--registers``, ``--rgs-reward``, ``--rgs-reward-kwargs``, ``--rgs-gradient``, ``--rgs-bands``; see
``flowalign.inference``). The budget is per prompt. Every check on the settings runs before the model loads,
and what the sampler needs (a differentiable image reward, registers) is built from its settings.

A differentiable image reward is any registered reward with the entry point ``forward(images, prompts, metadata)``
(``flowalign.rewards``): the zoo's pickscore, hps, clipscore, aesthetic, imagereward, and toy_geneval_soft.

Classifier-free guidance (``--cfg SCALE``, every sampler): with ``SCALE > 1`` (on a model whose ``uses_cfg`` says so;
FLUX.1-dev's guidance embedding takes the scale in one pass) each velocity is
``v_uncond + SCALE (v_cond - v_uncond)`` with the negative prompt ``""``, as ``StableDiffusion3Pipeline`` does, and
costs 2 NFEs per sample (``evals_per_sample = 2``); a backward pass through such a velocity (RGS) costs 2 as well.

Outputs. One image per prompt: ``images/NNNN.png`` (prompt ``NNNN``) and one row per prompt in ``results.json``. A
sampler returning a set of ``k`` images per prompt: ``images/NNNN_JJ.png`` and one row per image (``image_index``),
with the prompt's NFEs on each of its rows. A ``--out`` folder holding an earlier run's outputs is refused before
the model loads (``flowalign.outputs``: never two runs' images side by side); ``--overwrite`` deletes those files,
and only those, just before the new ones are written.

A video model (``modality == "video"``: decoded samples ``[F, 3, H, W]``) writes ``videos/NNNN.mp4`` and its frame
strip ``videos/NNNN.png`` instead of ``images/NNNN.png`` (``NNNN_JJ`` for a set), ``grid.mp4`` (the first
``GRID_VIDEOS`` videos tiled per frame) and ``grid.png`` (their frame strips captioned with the prompt), at ``--fps``
(default: the model's ``fps``, else 16) with ``--strip-frames`` evenly spaced frames per strip
(``flowalign.evaluation.videos``). ``results.json`` has the same rows, each with its ``video`` and ``frame_strip``
file, and the summary adds ``modality``, ``frames``, ``fps`` and ``video_codec``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.config import ConfigError, component
from flowalign.devices import resolve_device
from flowalign.outputs import OutputFolder, write_atomically
from flowalign.inference.base import RGS_GRADIENTS, latent_reward  # re-exported (bench/guided.py)
from flowalign.samplers.guided import GuidedResult
from flowalign.seeding import generator as seeded_generator
from flowalign.settings import at_least, flagged, option, parse_json_object

__all__ = ["RGS_GRADIENTS", "SampleConfig", "build_guide_reward", "encode_prompts", "latent_reward",
           "prompt_velocity", "run_guided", "run_sample"]

# What run_sample writes into --out (flowalign.outputs.OutputFolder: an earlier run's are refused or replaced).
SAMPLE_OUTPUTS = ("results.json", "summary.md", "grid.png", "images/[0-9]*.png", "grid.mp4", "videos/[0-9]*.mp4",
                  "videos/[0-9]*.png")
GRID_VIDEOS = 16  # a video model's grid.mp4 / grid.png show this many videos

# The settings SampleConfig had before the samplers were components -> their name in the sampler's settings; the
# Python constructor still takes them (``SampleConfig(guidance="fk", lam=5)``), for the sampler that has them.
LEGACY_SETTINGS = {"noise_level": "noise_level", "lam": "lam", "potential": "potential",
                   "fk_resample_start": "resample_start", "max_children": "max_children", "dts_soft": "soft",
                   "registers": "registers", "rgs_reward": "reward", "rgs_reward_kwargs": "reward_kwargs",
                   "rgs_gradient": "gradient", "rgs_bands": "bands"}


@dataclass(init=False)
class SampleConfig:
    """Settings of ``flowalign sample`` (per-prompt NFE ``budget``; see the module docstring). ``lora``: a trained
    LoRA (a checkpoint, with ``lora_weights`` ema/last, or a LoRA folder; ``flowalign.lora_loading``) on ``model``,
    which defaults to the checkpoint's base model, else ``assets/toy-sd3``."""

    model: str | None = option(None, "diffusers pipeline directory (default: a --lora checkpoint's model, else "
                               "assets/toy-sd3)")
    lora: str | None = option(None, "a trained LoRA: a checkpoint directory (checkpoint-NNNNNN) or a diffusers LoRA "
                              "folder (e.g. a checkpoint's lora/, its last weights); --model defaults to the "
                              "checkpoint's model", metavar="DIR")
    lora_weights: Literal["ema", "last"] | None = option(None, "a checkpoint's EMA or last weights (default: ema when it has them, else "
                                      "last)", flag="weights")
    prompts: str | None = option(None, "prompt file: .txt (one prompt a line) or .jsonl ({prompt, ...} a line; GenEval "
                                       "metadata for the GenEval rewards; images: condition image paths, relative to "
                                       "the file, for an editing model) (default: assets/prompts/test.jsonl)")
    sampler: ComponentConfig = flagged(component("flowalign.inference:SAMPLERS", "bon",
                                                 "the guided sampler and its settings"), "guidance")
    budget: int = option(40, "NFEs per prompt (for the whole set with --candidates)")
    candidates: int = option(1, "K images per prompt: a set from every method (best-of-N's K best, FK's K particles, "
                             "DTS's K best leaves, K RGS / Euphonium / SatisDive trajectories), with its worst-candidate "
                             "reward and diversity", metavar="K")
    diversity: str = option("auto", "image embedding that measures a set's diversity (mean pairwise cosine distance): "
                            "auto (toy_scene on the toy world, else pixels), or a registered embedding (toy_scene, "
                            "pixels, clip, dreamsim)", metavar="NAME")
    diversity_kwargs: dict[str, Any] = option({}, "--diversity's constructor arguments as a JSON object, e.g. local "
                                              "weights: '{\"path\": \"/w/dreamsim\"}'", parse=parse_json_object,
                                              metavar="JSON")
    steps: int = option(10, "sampler steps per trajectory")
    seed: int = option(0, "noise seed (prompt p's draws from the generator keyed (seed, p))")
    reward: str = option("toy_geneval", "registered image reward that scores samples")
    reward_kwargs: dict[str, Any] = option({}, "--reward's constructor arguments as a JSON object, e.g. local "
                                           "weights: '{\"model\": \"/w/PickScore_v1\", \"processor\": \"/w/CLIP\"}'",
                                           parse=parse_json_object, metavar="JSON")
    partial_credit: bool = option(True, "toy_geneval gives partial credit (--binary-reward: it does not)",
                                  flag="binary-reward", flag_value=False)
    reward_frames: dict[str, Any] | None = option(
        None, "on a video model, how an image --reward scores a clip from its frames, as a JSON object: "
              "'{\"aggregate\": \"mean\"}' (or min, or \"weights\": [...]; flowalign.reward_models.frames)",
        parse=parse_json_object, metavar="JSON")
    max_prompts: int | None = option(None, "sample only the first M prompts")
    batch_prompts: int = option(16, "prompts sampled at once")
    out_dir: str = option("outputs/sample", "output directory", flag="out")
    overwrite: bool = option(False, "replace the outputs of an earlier run in --out (deletes the files this command "
                                    "writes there, and only those)")
    device: str | None = option(None, "torch device (default: cuda when available, else cpu)")
    cfg: float = option(1.0, "classifier-free guidance scale (negative prompt ''), for every sampler; > 1 costs 2 "
                        "NFEs per sample and step; 1 = off", metavar="SCALE")
    fps: float | None = option(None, "a video model's mp4 frame rate; null = the model's fps, else 16")
    strip_frames: int = option(8, "frames in each video's frame strip PNG, evenly spaced from first to last; 0 = all")

    def __init__(self, guidance: str | None = None, **kwargs: Any):
        """The fields as keywords; ``guidance`` (the sampler's name) and the settings of ``LEGACY_SETTINGS`` build
        ``sampler`` as before the samplers were components (settings the chosen sampler lacks are dropped)."""
        from flowalign.inference import SAMPLERS

        legacy = {key: kwargs.pop(key) for key in list(kwargs) if key in LEGACY_SETTINGS}
        for f in dataclasses.fields(self):
            if f.name in kwargs:
                value = kwargs.pop(f.name)
            elif f.default is not dataclasses.MISSING:
                value = f.default
            else:
                value = f.default_factory()  # type: ignore[misc]
            setattr(self, f.name, value)
        if kwargs:
            raise TypeError(f"SampleConfig got an unexpected keyword argument {next(iter(kwargs))!r}")
        if guidance is not None or legacy:
            name = guidance if guidance is not None else self.sampler.name
            settings = SAMPLERS.config_class(name)
            known = {f.name for f in dataclasses.fields(settings)}
            values = {LEGACY_SETTINGS[k]: v for k, v in legacy.items() if LEGACY_SETTINGS[k] in known}
            if "bands" in values:
                values["bands"] = [list(band) for band in values["bands"]]
            if "reward_kwargs" in values and values["reward_kwargs"] is None:
                values["reward_kwargs"] = {}
            self.sampler = settings(name=name, **values)

    @property
    def guidance(self) -> str:
        """The guided sampler's name."""
        return self.sampler.name

    def build_sampler(self):
        """The configured ``GuidedSampler``."""
        from flowalign.inference import SAMPLERS

        return SAMPLERS.build(self.sampler.name, self.sampler)

    def evals_per_step(self, transformer_config: dict | None = None) -> int:
        """Transformer passes per sample and step: 2 with CFG (``cfg > 1``), unless the transformer's config says it
        takes the scale through a guidance embedding (FLUX.1-dev), as ``FlowModel.uses_cfg`` decides."""
        if not self.cfg > 1:
            return 1
        return 1 if (transformer_config or {}).get("guidance_embeds", False) else 2

    def validate(self, transformer_config: dict | None = None) -> None:
        """ConfigError naming the first bad setting; cheap (no model is loaded). With ``transformer_config`` (the
        model's ``transformer/config.json``, when local) the budget check counts CFG's second pass; without it, only
        the steps (the sampler checks the exact cost again once the model is loaded)."""
        from flowalign.inference import SAMPLERS

        if self.sampler.name not in SAMPLERS:
            close = SAMPLERS.closest(self.sampler.name)
            raise ConfigError(f"unknown guidance {self.sampler.name!r}: expected one of {', '.join(SAMPLERS.names())}"
                              + (f"; did you mean {close!r}?" if close else ""), key="sampler.name")
        for name in ("budget", "steps", "batch_prompts", "candidates"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}", key=name)
        number = isinstance(self.cfg, (int, float)) and not isinstance(self.cfg, bool)
        if not (number and math.isfinite(self.cfg) and self.cfg >= 1):
            raise ConfigError(f"cfg must be a finite number >= 1 (the classifier-free guidance scale; 1 = off), got "
                              f"{self.cfg!r}", key="cfg")
        self.sampler.validate()
        sampler = self.build_sampler()
        per_trajectory = self.steps * (1 if transformer_config is None else self.evals_per_step(transformer_config))
        if sampler.uses_budget and self.budget < per_trajectory:
            cost = f"{self.steps} NFEs" if per_trajectory == self.steps else f"{per_trajectory} NFEs with --cfg"
            raise ConfigError(
                f"budget={self.budget} NFEs per prompt is smaller than one trajectory of {self.steps} steps "
                f"({cost}): raise --budget to at least {per_trajectory} or lower --steps", key="budget"
            )
        per_candidate = sampler.trajectories_per_candidate
        if sampler.uses_budget and per_candidate and self.candidates * per_candidate * per_trajectory > self.budget:
            need = self.candidates * per_candidate * per_trajectory
            raise ConfigError(
                f"--candidates {self.candidates}: {self.sampler.name} needs at least {per_candidate} trajectory of "
                f"{per_trajectory} NFEs per candidate, {need} NFEs per prompt, and --budget is {self.budget}: raise "
                f"--budget to at least {need} or lower --candidates", key="candidates")
        sampler.check(self)
        from flowalign.embeddings import check_embedding

        check_embedding(self.diversity, self.diversity_kwargs, key="diversity")
        at_least("max_prompts", self.max_prompts, 1)
        from flowalign.evaluation.videos import check_fps, check_strip_frames

        for key, value, checker in (("fps", self.fps, check_fps), ("strip_frames", self.strip_frames,
                                                                    check_strip_frames)):
            if value is not None:
                try:
                    checker(value, key)
                except ValueError as error:
                    raise ConfigError(str(error), key=key) from None
        if self.lora_weights is not None and self.lora is None:
            raise ConfigError(f"--weights {self.lora_weights} chooses a checkpoint's weights: give the checkpoint "
                              "with --lora CHECKPOINT", key="lora_weights")
        unknown = sampler.requirements() - _provided()
        if unknown:
            raise ConfigError(f"guided sampler {self.sampler.name!r} needs {', '.join(sorted(unknown))}, which "
                              "flowalign sample does not provide", key="sampler.name")


def _provided() -> frozenset[str]:
    """What ``run_sample`` gives a sampler (``flowalign.inference.NEEDS``)."""
    return frozenset({"reward", "differentiable_reward", "registers", "image_embedding"})


def prompt_velocity(model, cond, guidance_scale: float = 1.0):
    """``velocity(x, sigma, rows)`` with prompt ``rows[i]``'s conditioning for row ``i``, at ``guidance_scale``
    (classifier-free guidance when ``model.uses_cfg(guidance_scale)``: ``cond`` then needs its negative embeddings,
    and each call costs 2 NFEs per row, ``evals_per_sample = 2``, as ``FlowModel.velocity_fn``)."""

    def velocity(x: Tensor, sigma: Tensor, rows: Tensor) -> Tensor:
        return model.velocity(x, sigma, cond.index(rows), guidance_scale)

    velocity.evals_per_sample = 2 if model.uses_cfg(guidance_scale) else 1
    return velocity


def encode_prompts(model, prompts: Sequence[str], guidance_scale: float = 1.0, *,
                   entries: Sequence[dict] | None = None):
    """``model.encode(prompts)``, with the empty negative prompt of every row when the scale means CFG (as the
    trainer and ``StableDiffusion3Pipeline`` with no ``negative_prompt``); ``entries`` (the prompts' metadata) give
    an editing prompt's condition images (``images``)."""
    from flowalign.data.condition_images import encode_kwargs

    negatives = [""] * len(prompts) if model.uses_cfg(guidance_scale) else None
    return model.encode(list(prompts), negative_prompts=negatives, **encode_kwargs(entries or []))


def run_guided(model, metadata: Sequence[dict], config: SampleConfig, *, reward_fn, registers=None,
               guide_reward=None, embedding=None, prompt_offset: int = 0) -> GuidedResult:
    """The configured guided sampler over ``metadata`` (one batch of prompts). Prompt ``p``'s randomness comes from
    the generator keyed ``(seed, prompt_offset + p)``. A sampler that needs them gets ``registers`` (RGS's register
    heads), the differentiable image reward ``guide_reward`` and the image ``embedding``."""
    from flowalign.inference.base import GuidedProblem

    prompts = [entry["prompt"] for entry in metadata]
    cond = encode_prompts(model, prompts, config.cfg, entries=metadata)
    problem = GuidedProblem(
        model=model, metadata=list(metadata), config=config, velocity=prompt_velocity(model, cond, config.cfg),
        reward=latent_reward(model, reward_fn, prompts, metadata), sigmas=model.sigmas(config.steps),
        shape=tuple(model.latent_shape(1)[1:]),
        generators=[seeded_generator(config.seed, prompt_offset + p) for p in range(len(prompts))],
        device=model.device, registers=registers, guide_reward=guide_reward, embedding=embedding,
        prompt_offset=prompt_offset)
    return config.build_sampler().sample(problem)


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


def check_sample_reward(config: SampleConfig, modality: str) -> None:
    """``--reward`` (with ``--reward-frames``) fits a model of ``modality``: an image reward on a video model needs
    ``--reward-frames``; a video reward needs a video model (``flowalign.rewards.check_reward_fits``)."""
    from flowalign.rewards import check_reward_fits

    check_reward_fits(config.reward, config.reward_frames, modality, at="--reward", frames_flag="--reward-frames")


def run_sample(config: SampleConfig) -> dict:
    """Check, load, sample every prompt and write the outputs; returns the summary written to results.json."""
    from dataclasses import replace

    from flowalign.data.condition_images import check_family_takes, has_condition_images
    from flowalign.data.prompts import load_prompts
    from flowalign.models.loading import adapter_class, names_adapter
    from flowalign.rewards import require_prompt_metadata
    from flowalign.evaluation.toy_eval import DEFAULT_MODEL, default_prompts_path
    from flowalign.errors import setup_phase
    from flowalign.lora_loading import base_model_path, load_model, resolve_lora

    with setup_phase():  # the user's mistakes, up to a loaded model, are reported as such (exit 2 on the CLI)
        config.validate()
        outputs = OutputFolder(Path(config.out_dir), SAMPLE_OUTPUTS, "flowalign sample")
        replacing = outputs.check(overwrite=config.overwrite)  # never two runs' images side by side
        sampler = config.build_sampler()
        needs = sampler.requirements()
        guide = sampler.differentiable_reward() if "differentiable_reward" in needs else None
        if guide is not None:  # a reward without a gradient is refused before anything is built or loaded
            from flowalign.rewards import require_differentiable_reward

            require_differentiable_reward(guide[0], "--rgs-reward")
        lora = resolve_lora(config.lora, config.lora_weights) if config.lora is not None else None
        model_path = base_model_path(config.model, lora, DEFAULT_MODEL)
        config = replace(config, model=model_path, lora_weights=None if lora is None else lora.weights)
        config.validate(read_transformer_config(model_path))  # the budget under CFG, exactly, before the model loads
        prompts_path = config.prompts or default_prompts_path()
        metadata = load_prompts(prompts_path)
        if config.max_prompts is not None:
            metadata = metadata[: config.max_prompts]
        require_prompt_metadata(config.reward, "--reward", metadata, prompts_path, config.reward_kwargs)
        if names_adapter(model_path):  # an image reward scores a video model's clips through --reward-frames
            check_sample_reward(config, getattr(adapter_class(model_path), "modality", "image"))
        if has_condition_images(metadata) or names_adapter(model_path):  # condition images for the families (only)
            check_family_takes(adapter_class(model_path), metadata, "--prompts", prompts_path)  # that take them
        if guide is not None:
            require_prompt_metadata(guide[0], "--rgs-reward", metadata, prompts_path, guide[1])
        registers, register_path = None, sampler.registers_checkpoint() if "registers" in needs else None
        if register_path is not None:
            from flowalign.reward_models.latent_registers import (check_transformer_config, load_registers,
                                                                  read_checkpoint)

            saved = read_checkpoint(register_path)["transformer_config"]
            actual = read_transformer_config(model_path)
            if actual is not None:  # before the model loads
                check_transformer_config(saved, actual, f"register checkpoint {register_path}")
        from flowalign.rewards import build_reward

        reward_kwargs = {"partial_credit": config.partial_credit} if config.reward == "toy_geneval" else {}
        from flowalign.rewards import check_reward_run

        # a reward fitted for one model (a manifold, a discriminator) fits this one, before it is built
        check_reward_run(config.reward, config.reward_kwargs, key="--reward-kwargs", model=model_path,
                         image_size=getattr(config, "image_size", None))
        if guide is not None:
            check_reward_run(guide[0], guide[1], key="--rgs-reward", model=model_path,
                             image_size=getattr(config, "image_size", None))
        from flowalign.embeddings import resolve_embedding

        embedding_name = resolve_embedding(config.diversity, model_path)
        reward_fn = build_reward(config.reward, **{**reward_kwargs, **config.reward_kwargs})
        if config.reward_frames is not None:
            from flowalign.reward_models.frames import over_frames

            reward_fn = over_frames(reward_fn, config.reward_frames, "--reward-frames")
        guide_reward = None if guide is None else build_guide_reward(guide[0], **guide[1])
        device = str(resolve_device(config.device))
        model = load_model(model_path, lora, device=device)
        check_sample_reward(config, getattr(model, "modality", "image"))  # a hub id's modality is known only now
    model.transformer.requires_grad_(False)
    from flowalign.rewards import bind_reward_model

    for built in (reward_fn, guide_reward):  # a reward conditioned on the model's text embeddings takes them here
        bind_reward_model(built, model)
    if register_path is not None:
        registers = load_registers(register_path, dict(model.transformer.config)).to(device)

    from flowalign.embeddings import build_embedding

    def embedding_model():
        return build_embedding(embedding_name, **{"device": device, **config.diversity_kwargs})

    embedding = embedding_model() if "image_embedding" in needs else None
    images, rewards, nfes = sample_prompts(model, metadata, config, reward_fn=reward_fn, registers=registers,
                                           guide_reward=guide_reward, embedding=embedding)
    diversity = None
    if rewards.dim() == 2:  # a set per prompt: its diversity in the configured embedding
        diversity = (embedding_name, measure_diversity(images, embedding or embedding_model()))
    if replacing:  # --overwrite: the earlier run's outputs go just before the first write
        outputs.replace_earlier()
    return write_outputs(config, metadata, images, rewards, nfes, diversity=diversity,
                         modality=getattr(model, "modality", "image"), model_fps=getattr(model, "fps", None))


def measure_diversity(images: Tensor, embedding) -> Tensor:
    """Each prompt's set diversity ``[P]`` (``flowalign.embeddings.set_diversity``) of ``images [P, K, 3, H, W]``
    in an image embedding (``flowalign.embeddings.build_embedding``)."""
    from flowalign.embeddings import set_diversity

    vectors = embedding.embed(images.flatten(0, 1))
    return set_diversity(vectors.reshape(images.shape[0], images.shape[1], -1))


def sample_prompts(model, metadata, config, *, reward_fn, registers=None, guide_reward=None,
                   embedding=None) -> tuple[Tensor, Tensor, Tensor]:
    """``run_guided`` over the prompts, ``config.batch_prompts`` at a time: decoded images ``[P, 3, H, W]`` on the CPU,
    the chosen samples' rewards ``[P]`` and the NFEs each prompt used ``[P]``; for a sampler returning a set of ``k``
    per prompt, images ``[P, k, 3, H, W]`` and rewards ``[P, k]``."""
    finals, rewards, nfes = [], [], []
    for start in range(0, len(metadata), config.batch_prompts):
        batch = metadata[start : start + config.batch_prompts]
        result = run_guided(model, batch, config, reward_fn=reward_fn, registers=registers,
                            guide_reward=guide_reward, embedding=embedding, prompt_offset=start)
        finals.append(result.final.detach())
        rewards.append(torch.as_tensor(result.reward).double().cpu())
        nfes.append(torch.as_tensor(result.nfe).cpu())
    rewards_all = torch.cat(rewards)
    with torch.no_grad():
        if rewards_all.dim() == 2:  # a set per prompt: decode the P * k latents, prompt-major
            k = rewards_all.shape[1]
            images = torch.cat([model.decode(f.flatten(0, 1)) for f in finals]).cpu()
            images = images.reshape(len(metadata), k, *images.shape[1:])
        else:
            images = torch.cat([model.decode(f) for f in finals]).cpu()
    return images, rewards_all, torch.cat(nfes)


def write_outputs(config: SampleConfig, metadata: Sequence[dict], images: Tensor, rewards: Tensor,
                  nfes: Tensor, *, diversity: tuple[str, Tensor] | None = None, modality: str = "image",
                  model_fps: float | None = None) -> dict:
    """``images/`` (a video model's ``videos/`` and ``grid.mp4``), ``grid.png``, ``results.json`` and ``summary.md``
    (module docstring); returns the summary. ``diversity``: the embedding's name and each prompt's set diversity,
    for a set per prompt. ``modality``: the model's (``"video"``: ``images`` holds videos ``[..., F, 3, H, W]``);
    ``model_fps``: the video model's frame rate, used when ``config.fps`` is null."""
    from flowalign.evaluation.images import save_grid, to_uint8

    out = Path(config.out_dir)
    sets = rewards.dim() == 2
    video = _is_video(modality, images, sets)
    k = int(rewards.shape[1]) if sets else 1
    flat_images = images.flatten(0, 1) if sets else images
    flat_rewards = rewards.flatten() if sets else rewards
    owners = [p for p in range(len(metadata)) for _ in range(k)]  # prompt of each image
    names = [f"{p:04d}_{j:02d}" if sets else f"{p:04d}" for p in range(len(metadata)) for j in range(k)]
    video_fields: dict[str, Any] = {}
    if video:
        video_fields = _write_videos(config, out, flat_images, names, [metadata[p]["prompt"] for p in owners],
                                     model_fps)
    else:
        from PIL import Image

        (out / "images").mkdir(parents=True, exist_ok=True)
        for name, pixels in zip(names, to_uint8(flat_images)):
            Image.fromarray(pixels).save(out / "images" / f"{name}.png")
    rows = []
    for index, (p, r) in enumerate(zip(owners, flat_rewards.tolist())):
        m = metadata[p]
        row = {"prompt_id": p, "prompt": m["prompt"], "tag": m.get("tag"), "reward": _num(r), "nfe": int(nfes[p])}
        if sets:
            filename = f"videos/{names[index]}.mp4" if video else f"images/{names[index]}.png"
            row = {**row, "image_index": index % k, "filename": filename}
        if video:
            row = {**row, "video": f"videos/{names[index]}.mp4", "frame_strip": f"videos/{names[index]}.png"}
        rows.append(row)
    summary: dict[str, Any] = {
        "config": asdict(config),
        "prompts": len(metadata),
        "mean_reward": _num(float(torch.nanmean(flat_rewards.double()))) if len(rows) else None,
        "mean_nfe": float(nfes.double().mean()),
        "max_nfe": int(nfes.max()),
    }
    summary.update(video_fields)
    if sets:
        summary["images_per_prompt"] = k
        summary.update(set_summary(rewards, None if diversity is None else diversity[1]))
        summary["diversity_embedding"] = None if diversity is None else diversity[0]
    if all("include" in m for m in metadata) and not video:  # the toy verifier reads images
        from flowalign.evaluation.geneval import overall_standard_error, summarize
        from flowalign.toy.reward import ToyGenEvalReward

        entries = [metadata[p] for p in owners]
        correct = ToyGenEvalReward()(flat_images, [m["prompt"] for m in entries], entries)
        for row, value in zip(rows, correct.tolist()):
            row["correct"] = bool(value)
        summary["geneval"] = {**summarize(rows), "overall_se": _num(overall_standard_error(rows))}
    if not video:
        save_grid(flat_images[:64], grid_captions(rows[:64]), out / "grid.png")
    summary["results"] = rows
    with write_atomically(out / "results.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=1))
    lines = [f"# flowalign sample: guidance {config.guidance}, budget {config.budget} NFEs/prompt, cfg {config.cfg:g}",
             "",
             f"prompts {len(metadata)}, mean reward {summary['mean_reward']}, mean NFEs {summary['mean_nfe']:.1f}"]
    if sets:
        lines.append(f"{k} images per prompt: mean worst-candidate reward {_fmt(summary['mean_worst_reward'])}, "
                     f"mean set diversity {_fmt(summary['mean_diversity'])} ({summary['diversity_embedding']} "
                     "embedding, mean pairwise cosine distance)")
        lines += ["", "| prompt | worst reward | mean reward | diversity |", "|---:|---:|---:|---:|"]
        lines += [f"| {row['prompt_id']} | {_fmt(row['worst_reward'])} | {_fmt(row['mean_reward'])} | "
                  f"{_fmt(row['diversity'])} |" for row in summary["sets"]]
    if video:
        lines.append(f"videos of {summary['frames']} frames at {summary['fps']:g} fps ({summary['video_codec']}): "
                     "videos/, grid.mp4, frame strips in grid.png")
    if "geneval" in summary:
        geneval = summary["geneval"]
        tags = len(geneval["tags"])
        lines.append(f"toy GenEval overall {geneval['overall']:.3f} ± {_fmt(geneval['overall_se'])} (standard error "
                     f"over {geneval['n_images']} images in {tags} tag{'' if tags == 1 else 's'}: a difference of less "
                     "than about two standard errors is noise)")
    with write_atomically(out / "summary.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    return summary


def grid_captions(rows: Sequence[dict]) -> list[str]:
    """``grid.png``'s caption of each image: ``prompt | reward``, and ``| yes`` / ``| no`` where the toy verifier
    judged it (``correct``)."""
    return [f"{row['prompt']} | {_fmt(row['reward'])}" + (f" | {'yes' if row['correct'] else 'no'}"
                                                           if "correct" in row else "") for row in rows]


def _is_video(modality: str, images: Tensor, sets: bool) -> bool:
    """Whether the decoded samples are videos: the model's ``modality``, checked against the tensor's shape."""
    expected = (5 if modality == "video" else 4) + (1 if sets else 0)
    if images.dim() != expected or images.shape[-3] != 3:
        layout = "[P, K, " if sets else "[P, "
        layout += "F, 3, H, W]" if modality == "video" else "3, H, W]"
        raise ValueError(f"a {modality} model's decoded samples must be {layout}, got shape {list(images.shape)}")
    return modality == "video"


def _write_videos(config: SampleConfig, out: Path, videos: Tensor, names: Sequence[str], captions: Sequence[str],
                  model_fps: float | None) -> dict[str, Any]:
    """``videos/NAME.mp4`` and ``videos/NAME.png`` per video ``[N, F, 3, H, W]``, ``grid.mp4`` and ``grid.png``;
    returns the summary's video fields."""
    from flowalign.evaluation.videos import (DEFAULT_FPS, captioned_strips, check_fps, grid_frames, mp4_codec,
                                             save_frame_strip, write_mp4, write_mp4_frames)

    fps = config.fps if config.fps is not None else (model_fps or DEFAULT_FPS)
    rate, codec = check_fps(fps, "fps"), mp4_codec()
    for name, clip in zip(names, videos):
        write_mp4(clip, out / "videos" / f"{name}.mp4", rate, codec=codec)
        save_frame_strip(clip, out / "videos" / f"{name}.png", config.strip_frames)
    write_mp4_frames(grid_frames(videos[:GRID_VIDEOS]), out / "grid.mp4", rate, codec=codec)
    captioned_strips(videos[:GRID_VIDEOS], list(captions[:GRID_VIDEOS]), out / "grid.png",
                     max_frames=config.strip_frames, columns=2)
    return {"modality": "video", "frames": int(videos.shape[1]), "fps": float(rate), "video_codec": codec}


def set_summary(rewards: Tensor, diversity: Tensor | None) -> dict:
    """Per prompt of ``rewards [P, K]``: the worst candidate's reward (the set's reward floor), the mean reward and
    the set diversity (``diversity [P]``, or None); and their means over prompts (NaN rewards skipped)."""
    rewards = rewards.double()
    worst = torch.where(rewards.isnan(), torch.inf, rewards).min(dim=1).values
    worst = torch.where(worst.isinf(), torch.nan, worst)
    mean = rewards.nanmean(dim=1)
    sets = [{"prompt_id": p, "worst_reward": _num(float(worst[p])), "mean_reward": _num(float(mean[p])),
             "diversity": None if diversity is None else float(diversity[p])} for p in range(rewards.shape[0])]
    return {"mean_worst_reward": _num(float(worst.nanmean())),
            "mean_diversity": None if diversity is None else float(diversity.double().mean()),
            "sets": sets}


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _num(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)
