"""DRL's discriminator reward: a projection logit on frozen image features (Beltran-Velez et al., arXiv 2606.19162).

A classifier between data images and the base model's samples, trained on a *frozen* feature ``f`` of the image:

    r(x, c) = phi(h(f)) + <h(f), e(c)> + b(c)

``h`` is linear to ``width`` (512 in the paper), ``phi`` linear to a scalar. The paper is class-conditional (``e``,
``b`` class embeddings); for text prompts flowalign takes ``e(c)`` and ``b(c)`` as linear maps of the base model's
pooled text embedding of the prompt (``conditioning = "text"``: an extrapolation, not in the paper), or drops them
(``conditioning = "none"``: ``r = phi(h(f))``, prompt-free). Its logit estimates ``log q(x) / p_base(x)``, the reward
whose KL-regularised optimum at ``lambda = 1`` is the data distribution.

Loss (per batch of real and fake images): ``softplus(-r(x_real)) + softplus(r(x_fake))`` averaged over each batch,
plus the R1 penalty ``gamma / 2 * mean_b ||grad_x r(x_real_b)||^2``, the gradient taken w.r.t. the **image**,
through the frozen feature extractor, its square summed over the pixels (``discriminator_loss``).

Features (``build_features``; frozen, ``forward(images [B, 3, H, W] in [0, 1]) -> [B, D]``):

* ``segmenter``: the pretrained toy shape segmenter's trunk (``flowalign.toy.segmenter``; default the embedded
  ``assets/toy-segmenter``), spatially averaged, with its four class probabilities averaged over the image, the whole
  vector layer-normalised (no affine: a fixed map, so the head sees unit-scale features as it does DINOv2's CLS).
* ``dinov2``: DINOv2's CLS token (``transformers.Dinov2Model`` ``pooler_output``) from a local directory or hub id,
  the images resized (bilinear) to its ``image_size`` and normalised with the ImageNet mean and std.

A checkpoint is ``NAME.safetensors`` (the head's weights) plus ``NAME.json``: the feature extractor (kind, path,
width, a fingerprint of its weights), the image size, the conditioning, the base model it was trained against
(``model_fingerprint``) and the validation accuracy. ``check_discriminator`` compares a sidecar with a run before any
model loads; ``DiscriminatorReward.check_run`` is how the trainer calls it.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["CONDITIONING", "DEFAULT_PATH", "FEATURE_KINDS", "DiscriminatorReward", "ProjectionDiscriminator",
           "build_features", "check_discriminator", "discriminator_loss", "feature_spec", "files_fingerprint",
           "load_discriminator", "model_fingerprint", "read_sidecar", "save_discriminator", "sidecar_path",
           "untrained_discriminator"]

FEATURE_KINDS = ("segmenter", "dinov2")
CONDITIONING = ("text", "none")
DEFAULT_PATH = "outputs/discriminator/discriminator.safetensors"
TRAIN_COMMAND = "flowalign prep train-discriminator"
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
_CHUNK = 1 << 20


# ------------------------------------------------------------------------------------------------ fingerprints


def files_fingerprint(paths: Sequence[Path]) -> str:
    """sha256 over each file's name, size and three 1 MiB samples (start, middle, end): cheap on multi-GB weights,
    and any retrained or fine-tuned weights differ in the sampled bytes. A fingerprint, not a proof of identity."""
    digest = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size};".encode())
        with path.open("rb") as handle:
            for offset in sorted({0, max(0, size // 2 - _CHUNK // 2), max(0, size - _CHUNK)}):
                handle.seek(offset)
                digest.update(handle.read(_CHUNK))
    return digest.hexdigest()[:16]


def model_fingerprint(model: str | Path) -> str:
    """The base model a discriminator was trained against: for a local pipeline directory, the fingerprint of its
    ``transformer/`` (config and weight files), so a copy elsewhere matches and another or fine-tuned transformer
    does not; for a hub id, ``hub:ID``."""
    folder = Path(model).expanduser() / "transformer"
    if not folder.is_dir():
        return f"hub:{model}"
    files = [p for p in folder.iterdir() if p.is_file() and (p.suffix in (".safetensors", ".bin") or p.name == "config.json")]
    return files_fingerprint(files)


def _feature_files(kind: str, path: str | None) -> tuple[str, list[Path]]:
    if kind == "segmenter":
        from flowalign.toy.segmenter import DEFAULT_SEGMENTER

        folder = Path(path) if path else DEFAULT_SEGMENTER
        return str(folder), [folder / "model.safetensors", folder / "config.json"]
    if not path:
        raise ValueError("features = 'dinov2' needs features_path: a local DINOv2 directory or a hub id "
                         "(e.g. facebook/dinov2-large)")
    folder = Path(path).expanduser()
    files = sorted(p for p in folder.iterdir() if p.is_file() and (p.suffix == ".safetensors" or p.suffix == ".bin"
                                                                     or p.name == "config.json")) if folder.is_dir() else []
    return str(path), files


def feature_spec(kind: str, path: str | None = None) -> dict:
    """``{kind, path, fingerprint}`` of a feature extractor, read from its files without building it."""
    if kind not in FEATURE_KINDS:
        raise ValueError(f"unknown feature extractor {kind!r}: expected one of {', '.join(FEATURE_KINDS)}")
    where, files = _feature_files(kind, path)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"feature extractor {kind} at {where}: missing {', '.join(missing)}")
    return {"kind": kind, "path": where, "fingerprint": files_fingerprint(files) if files else f"hub:{where}"}


# ------------------------------------------------------------------------------------------------ features


class SegmenterFeatures(nn.Module):
    """The toy segmenter's trunk averaged over the image (``width`` channels) and its class probabilities averaged
    over the image (4): ``[B, width + 4]``."""

    def __init__(self, path: str | None = None):
        super().__init__()
        from flowalign.toy.segmenter import load_segmenter

        segmenter = load_segmenter(path)
        self.trunk, self.classify = segmenter.net[:-1], segmenter.net[-1]
        self.dim = segmenter.width + self.classify.out_channels

    def forward(self, images: Tensor) -> Tensor:
        hidden = self.trunk(images.float() * 2.0 - 1.0)
        probabilities = self.classify(hidden).softmax(dim=1)
        pooled = torch.cat([hidden.mean(dim=(2, 3)), probabilities.mean(dim=(2, 3))], dim=1)
        return F.layer_norm(pooled, pooled.shape[1:])


class Dinov2Features(nn.Module):
    """DINOv2's CLS token (``pooler_output``, after the final layer norm) of the resized, normalised images."""

    def __init__(self, path: str):
        super().__init__()
        from transformers import Dinov2Model

        self.model = Dinov2Model.from_pretrained(path)
        self.size = int(self.model.config.image_size)
        self.dim = int(self.model.config.hidden_size)
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def forward(self, images: Tensor) -> Tensor:
        images = images.float()
        if images.shape[-2:] != (self.size, self.size):
            images = F.interpolate(images, size=(self.size, self.size), mode="bilinear", align_corners=False)
        pixels = ((images - self.mean) / self.std).to(self.model.dtype)
        return self.model(pixel_values=pixels).pooler_output.float()


def build_features(kind: str, path: str | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """The frozen feature extractor ``kind`` (``FEATURE_KINDS``), in eval mode, without gradients to its weights."""
    if kind == "segmenter":
        module = SegmenterFeatures(path)
    elif kind == "dinov2":
        if not path:
            raise ValueError("features = 'dinov2' needs features_path (a local DINOv2 directory or a hub id)")
        module = Dinov2Features(path)
    else:
        raise ValueError(f"unknown feature extractor {kind!r}: expected one of {', '.join(FEATURE_KINDS)}")
    return module.to(device).eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------ the head


class ProjectionDiscriminator(nn.Module):
    """``r(f, c) = phi(h(f)) + <h(f), e(c)> + b(c)`` (module docstring); without ``text_dim`` just ``phi(h(f))``.
    ``e`` and ``b`` start at zero, so an untrained head is the prompt-free one."""

    def __init__(self, feature_dim: int, *, text_dim: int | None = None, width: int = 512):
        super().__init__()
        self.h = nn.Linear(feature_dim, width)
        self.phi = nn.Linear(width, 1)
        self.text_dim = text_dim
        if text_dim:
            self.e = nn.Linear(text_dim, width)
            self.b = nn.Linear(text_dim, 1)
            for layer in (self.e, self.b):
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)

    def forward(self, features: Tensor, text: Tensor | None = None) -> Tensor:
        hidden = self.h(features.float())
        logit = self.phi(hidden)[:, 0]
        if self.text_dim:
            if text is None:
                raise ValueError("this discriminator is text-conditioned: give the pooled text embeddings")
            text = text.float().to(hidden.device)
            logit = logit + (hidden * self.e(text)).sum(dim=1) + self.b(text)[:, 0]
        return logit


def discriminator_loss(score, real: Tensor, fake: Tensor, *, real_text: Tensor | None = None,
                       fake_text: Tensor | None = None, gamma: float = 0.0) -> dict[str, Tensor]:
    """The logistic loss with R1 of the module docstring. ``score(images, text) -> logits [B]`` runs the frozen
    features and the head. Returns ``loss`` (what to minimise) and its parts ``real`` (mean softplus(-r_real)),
    ``fake`` (mean softplus(r_fake)), ``r1`` (``mean_b ||grad_x r(x_real_b)||^2``, 0 when ``gamma = 0``) and the
    logits ``logits_real``, ``logits_fake`` (detached)."""
    real = real.detach().float().requires_grad_(gamma > 0)
    logits_real = score(real, real_text)
    logits_fake = score(fake.detach().float(), fake_text)
    loss_real, loss_fake = F.softplus(-logits_real).mean(), F.softplus(logits_fake).mean()
    if gamma > 0:
        (grad,) = torch.autograd.grad(logits_real.sum(), real, create_graph=True)
        r1 = grad.pow(2).flatten(1).sum(dim=1).mean()
    else:
        r1 = logits_real.new_zeros(())
    return {"loss": loss_real + loss_fake + gamma / 2 * r1, "real": loss_real, "fake": loss_fake, "r1": r1,
            "logits_real": logits_real.detach(), "logits_fake": logits_fake.detach()}


# ------------------------------------------------------------------------------------------------ checkpoints


def sidecar_path(path: str | Path) -> Path:
    """``NAME.json`` next to ``NAME.safetensors``."""
    return Path(path).with_suffix(".json")


def save_discriminator(head: ProjectionDiscriminator, path: str | Path, meta: Mapping[str, Any]) -> Path:
    """Write the head's weights to ``path`` (safetensors) and ``meta`` (plus the head's shape) to its sidecar, each
    through a temporary file renamed into place, the sidecar first: a reader that finds the weights finds their
    sidecar (``train-discriminator`` refuses an existing ``path``, so the pair is always new)."""
    from safetensors.torch import save_file

    from flowalign.outputs import write_atomically

    path = Path(path)
    shape = {"feature_dim": head.h.in_features, "width": head.h.out_features, "text_dim": head.text_dim}
    # each file whole (a temporary file renamed into place), the sidecar first: weights are never seen without it
    with write_atomically(sidecar_path(path)) as tmp:
        tmp.write_text(json.dumps({**dict(meta), "head": shape}, indent=1, sort_keys=True) + "\n")
    with write_atomically(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}, str(tmp))
    return path


def read_sidecar(path: str | Path, key: str = "path") -> dict:
    """The sidecar of checkpoint ``path``; FileNotFoundError naming ``key`` and the command that makes one."""
    path = Path(path)
    if not path.is_file() or not sidecar_path(path).is_file():
        missing = path if not path.is_file() else sidecar_path(path)
        raise FileNotFoundError(
            f"{key} = {str(path)!r}: no discriminator checkpoint ({missing} is missing). Train one for this model with "
            f"`{TRAIN_COMMAND} --model MODEL --out {path}` (it writes the .safetensors and its .json)")
    try:
        meta = json.loads(sidecar_path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{sidecar_path(path)} is not valid JSON ({error.msg}): write it again with "
                         f"`{TRAIN_COMMAND}`") from None
    needed = ("features", "image_size", "conditioning", "model_fingerprint", "head")
    absent = [k for k in needed if k not in meta]
    if absent:
        raise ValueError(f"{sidecar_path(path)} is not a discriminator sidecar (no {', '.join(absent)}): write it "
                         f"again with `{TRAIN_COMMAND}`")
    return meta


def check_discriminator(path: str | Path, *, model: str | None = None, image_size: Any = None,
                        key: str = "path") -> dict:
    """The sidecar of ``path``, checked against the run: the base ``model`` it will score samples of (its
    fingerprint), the ``image_size`` of those samples (an int or ``(H, W)``; None: not checked) and the feature
    extractor's files. A mismatch is a ValueError naming the file, what differs, and the command that makes a
    fitting checkpoint; nothing is built and no model loads."""
    meta = read_sidecar(path, key)
    fix = f"train a discriminator for it with `{TRAIN_COMMAND} --model {model or 'MODEL'} --out {path}`"
    if model is not None and meta["model_fingerprint"] != model_fingerprint(model):
        raise ValueError(
            f"{key} = {str(path)!r} was trained against another base model ({meta.get('model', '?')}, fingerprint "
            f"{meta['model_fingerprint']}) than {model} (fingerprint {model_fingerprint(model)}): its logit measures "
            f"how that model's samples differ from the data; {fix}")
    if image_size is not None:
        size = [image_size, image_size] if isinstance(image_size, int) else [int(s) for s in image_size]
        if list(meta["image_size"]) != size:
            raise ValueError(f"{key} = {str(path)!r} was trained on {meta['image_size'][0]}x{meta['image_size'][1]} "
                             f"images, the run samples {size[0]}x{size[1]}: set sampling.image_size to "
                             f"{meta['image_size'][0]}, or {fix} at --image-size {size[0]}")
    spec = meta["features"]
    try:
        now = feature_spec(spec["kind"], spec.get("path"))
    except (FileNotFoundError, ValueError) as error:
        raise ValueError(f"{key} = {str(path)!r}: its feature extractor cannot be read ({error})") from None
    if now["fingerprint"] != spec.get("fingerprint"):
        raise ValueError(f"{key} = {str(path)!r} was trained on other {spec['kind']} features than the ones at "
                         f"{spec['path']} now (fingerprint {spec.get('fingerprint')} vs {now['fingerprint']}): {fix}")
    return meta


def untrained_discriminator(model: str | Path, out: str | Path, *, image_size: int, features: str = "segmenter",
                            features_path: str | None = None, conditioning: str = "none", width: int = 512,
                            seed: int = 0) -> Path:
    """Write a checkpoint of an untrained head (``torch.manual_seed(seed)``) for the local base pipeline ``model``
    (text-conditioned on its transformer's ``pooled_projection_dim``): a fitting input for tests and smoke runs of the
    reward (its logit carries no information about the data)."""
    spec = feature_spec(features, features_path)
    text_dim = None
    if conditioning == "text":
        text_dim = int(json.loads((Path(model) / "transformer" / "config.json").read_text())["pooled_projection_dim"])
    torch.manual_seed(seed)
    dim = build_features(features, features_path).dim
    head = ProjectionDiscriminator(dim, text_dim=text_dim, width=width)
    meta = {"features": {**spec, "dim": int(dim)}, "image_size": [image_size, image_size],
            "conditioning": conditioning, "model": str(model),
            "model_fingerprint": model_fingerprint(model), "val_accuracy": None, "untrained": True}
    return save_discriminator(head, out, meta)


def load_discriminator(path: str | Path, device: str | torch.device = "cpu") -> tuple[ProjectionDiscriminator, dict]:
    """``(head, sidecar)`` of a checkpoint, the head frozen in eval mode."""
    from flowalign.serialization import read_safetensors

    meta = read_sidecar(path)
    shape = meta["head"]
    head = ProjectionDiscriminator(shape["feature_dim"], text_dim=shape["text_dim"], width=shape["width"])
    head.load_state_dict(read_safetensors(path, "a discriminator checkpoint"))
    return head.to(device).eval().requires_grad_(False), meta


# ------------------------------------------------------------------------------------------------ text


class TextEmbeddings:
    """Pooled text embeddings per prompt, computed once and cached (GRPO groups repeat every prompt)."""

    def __init__(self, encode):
        self.encode, self.cache = encode, {}

    def __call__(self, prompts: Sequence[str], device) -> Tensor:
        todo = [p for p in dict.fromkeys(prompts) if p not in self.cache]
        if todo:
            with torch.no_grad():
                for prompt, row in zip(todo, self.encode(todo).cpu()):
                    self.cache[prompt] = row
        return torch.stack([self.cache[p] for p in prompts]).to(device)


# ------------------------------------------------------------------------------------------------ the reward


class DiscriminatorReward:
    """The discriminator's logit as a reward (``discriminator``, ``path=`` a checkpoint of
    ``flowalign prep train-discriminator``). Differentiable in the images (``forward``)."""

    name = "discriminator"
    reads_geneval_metadata = False
    negative_scores = "it is a logit, log q/p_base: negative where a sample looks more like the base model's than data"

    def __init__(self, path: str = DEFAULT_PATH, *, device: str | torch.device | None = None, batch_size: int = 64):
        from flowalign.devices import resolve_device

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"discriminator: batch_size must be an integer >= 1, got {batch_size!r}")
        self.path, self.batch_size = str(path), batch_size
        self.device = resolve_device(device)
        self.head, self.meta = load_discriminator(path, self.device)
        spec = self.meta["features"]
        self.features = build_features(spec["kind"], spec.get("path"), self.device)
        self.text = None  # text conditioning: the run's model's pooled embeddings, handed over by bind_model

    def bind_model(self, model) -> None:
        """Take the pooled text embeddings of the run's loaded model (``flowalign.rewards.bind_reward_model``): the
        text encoders are frozen, so they are the base model's the head was trained with."""
        if self.meta["conditioning"] == "text":
            self.text = TextEmbeddings(lambda prompts: model.encode(list(prompts)).sentence_embedding().float())

    @classmethod
    def check_run(cls, kwargs: Mapping[str, Any], *, key: str, model: str | None, image_size: Any) -> None:
        """Before anything is built: the checkpoint exists and fits the run's base model and image size."""
        check_discriminator(kwargs.get("path", DEFAULT_PATH), model=model, image_size=image_size, key=f"{key}.path")

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """Logits ``[B]`` of images already at the checkpoint's size (keeps the graph)."""
        text = None
        if self.meta["conditioning"] == "text":
            if self.text is None:
                raise RuntimeError(f"discriminator {self.path!r} is text-conditioned: hand it the run's model first "
                                   "(flowalign.rewards.bind_reward_model(reward, model))")
            text = self.text(prompts, self.device)
        return self.head(self.features(images), text)

    def forward(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        size = tuple(self.meta["image_size"])
        if tuple(images.shape[-2:]) != size:
            raise ValueError(f"discriminator {self.path} scores {size[0]}x{size[1]} images, got "
                             f"{images.shape[-2]}x{images.shape[-1]}: sample at its size or train one for yours")
        return self.score(images.to(self.device), list(prompts))

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        prompts = list(prompts)
        out = []
        with torch.no_grad():
            for start in range(0, images.shape[0], self.batch_size):
                chunk = images[start:start + self.batch_size]
                out.append(self.forward(chunk, prompts[start:start + self.batch_size]).float().cpu())
        return torch.cat(out) if out else torch.zeros(0)


def accuracy(logits_real: Tensor, logits_fake: Tensor) -> float:
    """The fraction of real images with a positive logit and fake ones with a negative one (0 counts half)."""
    scores = torch.cat([torch.sign(logits_real.float()), -torch.sign(logits_fake.float())])
    return float(((scores + 1) / 2).mean()) if scores.numel() else math.nan
