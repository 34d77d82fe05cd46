"""Shell-LCC: a data-manifold model of VAE latents and its distance as a differentiable latent reward.

Reference: Zhang et al., "Your Data Manifold is Secretly a Reward Model", ECCV 2026, arXiv 2606.30248; the public
code is needylove/Shell-LCC (``manifold/shell_lcc.py::ShellCoordinateManifold``). ``ShellLCC`` keeps that class's
parameter names (``basis``, ``global_scale``, ``global_bias``, ``predictor``, ``surface_head``), so a manifold fitted by
the authors' code loads unchanged (``load_manifold`` reads their ``{"model": state_dict, "config": ...}`` ``.pth``).

Points are single latent positions ``z in R^C``: a latent ``(B, C, T, H, W)`` (an image latent ``(B, C, H, W)`` is a
one-frame video ``(B, C, 1, H, W)``) is flattened to ``N = B T H W`` points. With ``K`` bases ``b_k`` (``basis``):

    w      = softmax(predictor(z))                         predictor: Linear-BatchNorm-ReLU-Linear-ReLU-Linear
    z_hat  = (w basis) * global_scale + global_bias        the local-coordinate-coding ("LCC") skeleton
    h      = surface_head(z_hat)                           Linear-ReLU-Linear, per-channel "log-variance"
    d      = || (z - z_hat) / (exp(h) + 1e-6) ||_2         the normalised distance of z to the shell

The reward is ``R(z) = mean d`` over positions (and the batch), minimised, with the model in eval mode (BatchNorm's
running statistics); the band variant minimises ``|R - tau|``. As the public code, ``d`` divides by ``exp(h)``, a
variance by the head's name, not a standard deviation (docs/methods/shell_lcc.md).

Fitting (``fit_manifold``, the public two-stage schedule):

* stage 1, LCC, BatchNorm in train mode: ``MSE(z_hat, z) + L_loc + lambda_usage KL(u || uniform) + lambda_b2d L_b2d``
  with ``L_loc = mean_n sum_k w_nk ||z_n - b_k||^2``, ``u`` the mean coding (+ 1e-8, renormalised), and
  ``L_b2d = mean_k ||b_k - z_nearest(b_k)||^2`` (the public code's ``basis_to_patch``);
* stage 2, shell: the LCC parameters frozen, the predictor's BatchNorm in eval mode, only ``surface_head`` trains on
  ``MSE + L_loc + mean (d - 1)^2 + 0.01 mean h^2`` (the public code's ``stage='joint'`` loss).

A checkpoint is a safetensors file of the state dict and a JSON sidecar (``<file>.json``) with the sizes, the latent
channels and what it was fitted for: the pipeline, its VAE config and the sha256 of the VAE weights
(``vae_fingerprint``); ``check_fitted_for`` refuses a manifold made for another VAE, naming the file and the command
that fits one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FIT_COMMAND", "ShellLCC", "ShellLCCReward", "check_fitted_for", "fit_manifold", "load_manifold",
           "read_sidecar", "save_manifold", "sidecar_path", "vae_fingerprint", "vae_fingerprint_of"]

logger = logging.getLogger(__name__)

FIT_COMMAND = "flowalign prep fit-manifold"
FORMAT = "flowalign.shell_lcc/1"


class ShellLCC(nn.Module):
    """The Shell-LCC manifold of ``embedding_dim``-channel latent positions (module docstring)."""

    def __init__(self, embedding_dim: int = 16, num_bases: int = 4096, hidden_dim: int = 256):
        super().__init__()
        self.embedding_dim, self.num_bases, self.hidden_dim = int(embedding_dim), int(num_bases), int(hidden_dim)
        self.basis = nn.Parameter(torch.empty(num_bases, embedding_dim))
        nn.init.xavier_uniform_(self.basis)
        self.global_scale = nn.Parameter(torch.ones(1))
        self.global_bias = nn.Parameter(torch.zeros(1, embedding_dim))
        self.predictor = nn.Sequential(
            nn.Linear(embedding_dim, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, num_bases))
        self.surface_head = nn.Sequential(nn.Linear(embedding_dim, hidden_dim), nn.ReLU(),
                                          nn.Linear(hidden_dim, embedding_dim))

    @property
    def sizes(self) -> dict[str, int]:
        return {"embedding_dim": self.embedding_dim, "num_bases": self.num_bases, "hidden_dim": self.hidden_dim}

    # --- the geometry -------------------------------------------------------------------------------------------
    def points(self, z: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        """``(N, C)`` points of a latent ``(B, C, T, H, W)`` or ``(B, C, H, W)`` (one frame), and the
        ``(B, T, H, W)`` they came from."""
        if z.ndim == 4:
            z = z.unsqueeze(2)
        if z.ndim != 5 or z.shape[1] != self.embedding_dim:
            raise ValueError(f"Shell-LCC manifold of {self.embedding_dim} latent channels got a latent of shape "
                             f"{tuple(z.shape)}; expected (B, {self.embedding_dim}, H, W) or "
                             f"(B, {self.embedding_dim}, T, H, W)")
        b, c, t, h, w = z.shape
        return z.float().permute(0, 2, 3, 4, 1).reshape(-1, c), (b, t, h, w)

    def coding(self, points: Tensor) -> Tensor:
        """The coding weights ``w = softmax(predictor(z))``, ``(N, K)``."""
        return F.softmax(self.predictor(points), dim=1)

    def skeleton(self, points: Tensor, w: Tensor | None = None) -> Tensor:
        """``z_hat = (w basis) global_scale + global_bias``, ``(N, C)``."""
        w = self.coding(points) if w is None else w
        return (w @ self.basis) * self.global_scale + self.global_bias

    def normalised_distance(self, points: Tensor, skeleton: Tensor) -> tuple[Tensor, Tensor]:
        """``(d [N], h [N, C])``: ``d = ||(z - z_hat) / (exp(h) + 1e-6)||`` with ``h = surface_head(z_hat)``."""
        log_var = self.surface_head(skeleton)
        return torch.linalg.vector_norm((points - skeleton) / (torch.exp(log_var) + 1e-6), dim=1), log_var

    def forward(self, z: Tensor) -> Tensor:
        """The distance ``d`` of every position, ``(B, T, H, W)`` (module docstring)."""
        points, shape = self.points(z)
        d, _ = self.normalised_distance(points, self.skeleton(points))
        return d.reshape(shape)

    def distance_reward(self, z: Tensor) -> Tensor:
        """``R(z)``: the mean of ``d`` over every position and the batch (a scalar, differentiable in ``z``)."""
        return self(z).mean()

    def sample_distances(self, z: Tensor) -> Tensor:
        """``R`` of each sample, ``[B]`` (their mean is ``distance_reward`` when samples have equal sizes)."""
        return self(z).flatten(1).mean(dim=1)

    def band_reward(self, z: Tensor, tau: float) -> Tensor:
        """``|R(z) - tau|``: the released band objective (``--reward_target``), a scalar."""
        return (self.distance_reward(z) - tau).abs()

    # --- the fitting losses ---------------------------------------------------------------------------------------
    def lcc_terms(self, points: Tensor, w: Tensor, skeleton: Tensor) -> tuple[Tensor, Tensor]:
        """``(MSE(z_hat, z), L_loc)``; ``||z - b||^2`` expanded as ``|z|^2 + |b|^2 - 2 z.b`` (clamped at 0)."""
        mse = F.mse_loss(skeleton, points)
        squared = (points.pow(2).sum(1, keepdim=True) + self.basis.pow(2).sum(1)[None] - 2 * points @ self.basis.T)
        return mse, (w * squared.clamp_min(0)).sum(1).mean()

    def basis_to_data(self, points: Tensor) -> Tensor:
        """``mean_k ||b_k - z_nearest(b_k)||^2``: pulls every basis onto its nearest data point."""
        squared = points.pow(2).sum(1, keepdim=True) + self.basis.pow(2).sum(1)[None] - 2 * points @ self.basis.T
        nearest = squared.argmin(dim=0)
        return (self.basis - points[nearest]).pow(2).sum(-1).mean()

    def lcc_loss(self, z: Tensor, *, lambda_usage: float = 0.1,
                 lambda_basis_to_data: float = 0.1) -> tuple[Tensor, dict[str, float]]:
        """Stage 1's loss (module docstring) and its parts (``kl`` weighted, ``basis_to_data`` not, as released)."""
        points, _ = self.points(z)
        w = self.coding(points)
        mse, local = self.lcc_terms(points, w, self.skeleton(points, w))
        loss, parts = mse + local, {"mse": float(mse.detach()), "locality": float(local.detach())}
        if lambda_usage > 0:
            usage = w.mean(dim=0) + 1e-8
            usage = usage / usage.sum()
            kl = lambda_usage * (usage * (usage.log() - math.log(1.0 / usage.numel()))).sum()
            loss, parts["kl"] = loss + kl, float(kl.detach())
        if lambda_basis_to_data > 0:
            b2d = self.basis_to_data(points)
            loss, parts["basis_to_data"] = loss + lambda_basis_to_data * b2d, float(b2d.detach())
        return loss, parts

    def shell_loss(self, z: Tensor) -> tuple[Tensor, dict[str, float]]:
        """Stage 2's loss: ``MSE + L_loc + mean (d - 1)^2 + 0.01 mean h^2`` (only ``surface_head`` trains)."""
        points, _ = self.points(z)
        w = self.coding(points)
        skeleton = self.skeleton(points, w)
        mse, local = self.lcc_terms(points, w, skeleton)
        d, log_var = self.normalised_distance(points, skeleton)
        shell = (d - 1).pow(2).mean()
        loss = mse + local + shell + 0.01 * log_var.pow(2).mean()
        return loss, {"mse": float(mse.detach()), "locality": float(local.detach()), "shell": float(shell.detach())}


# --- checkpoints ------------------------------------------------------------------------------------------------


def sidecar_path(path: str | Path) -> Path:
    """The JSON sidecar of a safetensors manifold: ``manifold.safetensors`` -> ``manifold.json``."""
    return Path(path).with_suffix(".json")


def _weights_sha256(folder: Path) -> str | None:
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _vae_config(config: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(config).items() if not k.startswith("_")}


def vae_fingerprint(model_path: str | Path) -> dict | None:
    """What a manifold is fitted for, read from a local pipeline directory without loading it: the path, the VAE
    config (without diffusers' private keys), its ``latent_channels`` and the sha256 of its weight files. None for a
    path without ``vae/config.json`` (a hub id)."""
    folder = Path(model_path) / "vae"
    if not (folder / "config.json").is_file():
        return None
    config = _vae_config(json.loads((folder / "config.json").read_text()))
    return {"model": str(model_path), "vae_config": config, "latent_channels": config.get("latent_channels"),
            "vae_weights_sha256": _weights_sha256(folder)}


def vae_fingerprint_of(model: Any) -> dict:
    """The fingerprint of a loaded ``FlowModel`` (its VAE config and latent channels; no weights hash)."""
    config = _vae_config(model.pipe.vae.config)
    return {"model": None, "vae_config": config, "latent_channels": config.get("latent_channels"),
            "vae_weights_sha256": None}


def check_fitted_for(meta: dict, fingerprint: dict | None, path: str | Path, key: str = "path") -> None:
    """ValueError naming the manifold ``path`` (set by ``key``) and the fix when it was fitted for another VAE than
    ``fingerprint``'s: other latent channels, another VAE config (shift, scale, architecture) or other VAE weights
    (compared when both sides know their hash). ``fingerprint`` None (a hub model): only what is known is checked."""
    if fingerprint is None:
        return
    fitted = meta.get("fitted_for") or {}
    fix = (f"fit a manifold on this model's latents with `{FIT_COMMAND} --model {fingerprint.get('model') or 'PATH'} "
           f"--out FILE` and point {key} at it")
    channels = meta.get("latent_channels")
    if channels is not None and fingerprint.get("latent_channels") not in (None, channels):
        raise ValueError(f"Shell-LCC manifold {str(path)!r} ({key}) was fitted on {channels}-channel latents, but the "
                         f"model's VAE has {fingerprint['latent_channels']} latent channels: {fix}")
    saved, actual = fitted.get("vae_config") or {}, fingerprint.get("vae_config") or {}
    diff = [k for k in sorted(set(saved) & set(actual)) if saved[k] != actual[k]]
    if diff:
        shown = "; ".join(f"{k}: {saved[k]!r} vs {actual[k]!r}" for k in diff[:4])
        raise ValueError(f"Shell-LCC manifold {str(path)!r} ({key}) was fitted for another VAE "
                         f"({fitted.get('model')!r}; manifold vs model: {shown}): {fix}")
    ours, theirs = fitted.get("vae_weights_sha256"), fingerprint.get("vae_weights_sha256")
    if ours and theirs and ours != theirs:
        raise ValueError(f"Shell-LCC manifold {str(path)!r} ({key}) was fitted for other VAE weights "
                         f"({fitted.get('model')!r}, sha256 {ours[:12]}..., this model's {theirs[:12]}...): {fix}")


def save_manifold(manifold: ShellLCC, path: str | Path, *, fitted_for: dict | None, extra: dict | None = None) -> Path:
    """Write ``path`` (safetensors state dict) and its JSON sidecar (sizes, latent channels, ``fitted_for``,
    ``extra``: the fit settings and statistics), each through a temporary file renamed into place, the sidecar
    first: a reader that finds the weights finds their sidecar (``fit-manifold`` refuses an existing ``path``, so
    the pair is always new)."""
    from safetensors.torch import save_file

    from flowalign.outputs import write_atomically

    path = Path(path)
    meta = {"format": FORMAT, **manifold.sizes, "latent_channels": manifold.embedding_dim,
            "fitted_for": fitted_for, **(extra or {})}
    # each file whole (a temporary file renamed into place), the sidecar first: weights are never seen without it
    with write_atomically(sidecar_path(path)) as tmp:
        tmp.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    with write_atomically(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in manifold.state_dict().items()}, str(tmp))
    return path


def missing_manifold(path: str | Path, key: str) -> FileNotFoundError:
    return FileNotFoundError(f"Shell-LCC manifold {str(path)!r} ({key}) does not exist: fit one on the model's VAE "
                             f"latents of data images with `{FIT_COMMAND} --model PATH --data toy --out {path}`")


def read_sidecar(path: str | Path, key: str = "path") -> dict:
    """The metadata of a manifold file, read without its weights: the sidecar of a safetensors file, the ``config``
    of a public-code ``.pth`` (``fitted_for`` unknown). Errors name the file, ``key`` and the fix."""
    path = Path(path)
    if not path.is_file():
        raise missing_manifold(path, key)
    if path.suffix == ".safetensors":
        side = sidecar_path(path)
        if not side.is_file():
            raise FileNotFoundError(f"Shell-LCC manifold {str(path)!r} ({key}) has no sidecar {str(side)!r} (what it "
                                    f"was fitted for); `{FIT_COMMAND}` writes both")
        from flowalign.serialization import read_json

        meta = read_json(side, "a Shell-LCC sidecar")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{str(side)!r} is not a Shell-LCC sidecar (format "
                         f"{meta.get('format') if isinstance(meta, dict) else None!r}, expected "
                             f"{FORMAT!r})")
        return meta
    from flowalign.serialization import safe_load

    blob = safe_load(path, "a Shell-LCC manifold")
    if not isinstance(blob, dict) or "model" not in blob or "config" not in blob:
        raise ValueError(f"{str(path)!r} ({key}) is not a Shell-LCC manifold: expected a safetensors file with a JSON "
                         "sidecar, or the public code's .pth with 'model' and 'config'")
    config = blob["config"]
    return {"embedding_dim": int(config["embedding_dim"]), "num_bases": int(config["num_bases"]),
            "hidden_dim": int(config["hidden_dim"]), "latent_channels": int(config["embedding_dim"]),
            "fitted_for": None}


def load_manifold(path: str | Path, key: str = "path") -> tuple[ShellLCC, dict]:
    """``(manifold in eval mode, metadata)`` from ``path``: a checkpoint of ``save_manifold``, or a manifold saved by
    the public code (``{"model": state_dict, "config": {embedding_dim, num_bases, hidden_dim}}``, DDP's ``module.``
    prefixes dropped), read with ``torch.load(weights_only=True)``."""
    meta = read_sidecar(path, key)
    path = Path(path)
    if path.suffix == ".safetensors":
        from flowalign.serialization import read_safetensors

        state = read_safetensors(path, "a Shell-LCC manifold")
    else:
        from flowalign.serialization import safe_load

        state = {k.removeprefix("module."): v for k, v in safe_load(path, "a Shell-LCC manifold")["model"].items()}
    manifold = ShellLCC(meta["embedding_dim"], meta["num_bases"], meta["hidden_dim"])
    manifold.load_state_dict(state)
    return manifold.eval(), meta


# --- fitting ----------------------------------------------------------------------------------------------------


def _batches(count: int, batch_size: int, generator: torch.Generator) -> list[Tensor]:
    """One epoch's shuffled batches of indices (the last partial batch dropped, as the public loader does)."""
    order = torch.randperm(count, generator=generator)
    return [order[i:i + batch_size] for i in range(0, count - batch_size + 1, batch_size)]


def fit_manifold(latents: Tensor, *, num_bases: int = 256, hidden_dim: int = 512, epochs_lcc: int = 5,
                 epochs_shell: int = 5, batch_size: int = 8, lr: float = 1e-3, lambda_usage: float = 0.1,
                 lambda_basis_to_data: float = 0.1, seed: int = 0, log_every: int = 0) -> tuple[ShellLCC, dict]:
    """The two-stage fit on latents ``(N, C, H, W)`` or ``(N, C, T, H, W)`` (module docstring), on their device.

    Every draw comes from generators keyed by ``seed`` (the initialisation, the basis's data points, each epoch's
    order), so a fit is bitwise repeatable on one machine. The bases start at ``num_bases`` data positions drawn
    without replacement (the public ``init_basis_with_random_samples``); Adam at ``lr`` in both stages. Returns the
    manifold in eval mode and the fit's statistics (final stage losses, the data's mean distance ``data_distance``).
    """
    if latents.ndim == 4:
        latents = latents.unsqueeze(2)
    count, channels = int(latents.shape[0]), int(latents.shape[1])
    if count < batch_size:
        raise ValueError(f"fit_manifold needs at least batch_size = {batch_size} latents, got {count}")
    points = latents.float().permute(0, 2, 3, 4, 1).reshape(-1, channels)
    if points.shape[0] < num_bases:
        raise ValueError(f"num_bases = {num_bases} is more than the {points.shape[0]} latent positions of the data: "
                         "lower num_bases or give more images")
    device = latents.device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        manifold = ShellLCC(channels, num_bases, hidden_dim)
    manifold.to(device)
    draws = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        manifold.basis.copy_(points[torch.randperm(points.shape[0], generator=draws)[:num_bases].to(device)])
    stats: dict[str, Any] = {}

    def run(stage: str, epochs: int, params: list[nn.Parameter]) -> dict[str, float]:
        optimizer = torch.optim.Adam(params, lr=lr)
        parts: dict[str, float] = {}
        for epoch in range(epochs):
            for step, rows in enumerate(_batches(count, batch_size, draws)):
                batch = latents[rows.to(device)]
                if stage == "lcc":
                    loss, parts = manifold.lcc_loss(batch, lambda_usage=lambda_usage,
                                                    lambda_basis_to_data=lambda_basis_to_data)
                else:
                    loss, parts = manifold.shell_loss(batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                parts["loss"] = float(loss.detach())
            if log_every and (epoch + 1) % log_every == 0:
                logger.info("shell-lcc %s epoch %d/%d: %s", stage, epoch + 1, epochs,
                            ", ".join(f"{k} {v:.4f}" for k, v in parts.items()))
        return parts

    manifold.train()
    if epochs_lcc > 0:
        stats["lcc"] = run("lcc", epochs_lcc, list(manifold.parameters()))
    for module in (manifold.predictor,):
        module.requires_grad_(False)
    for param in (manifold.basis, manifold.global_scale, manifold.global_bias):
        param.requires_grad_(False)
    manifold.predictor.eval()  # BatchNorm's running statistics are frozen in stage 2
    stats["shell"] = run("shell", epochs_shell, list(manifold.surface_head.parameters()))
    manifold.eval().requires_grad_(False)
    with torch.no_grad():
        distances = torch.cat([manifold(latents[i:i + 64]).flatten() for i in range(0, count, 64)])
    stats["data_distance"] = float(distances.mean())
    stats["data_distance_std"] = float(distances.std())
    return manifold, stats


# --- the reward ---------------------------------------------------------------------------------------------------

VARIANTS = ("distance", "band")


DEFAULT_PATH = "outputs/manifolds/shell_lcc.safetensors"  # where `flowalign prep fit-manifold` writes by default


class ShellLCCReward:
    """The Shell-LCC manifold as a reward of **latents** (``reads_latents``): the score of a sample is ``-R`` (its mean
    distance to the shell; ``variant: distance``) or ``-|R - tau|`` (``band``), so higher is better as every reward.

    ``tau`` None: the mean distance of the data the manifold was fitted on (its sidecar's ``data_distance``; 1 for a
    public-code manifold, the shell the fit aims at). The manifold runs in eval mode with frozen parameters, on the
    latents' device; ``forward`` keeps the gradient to the latents (RGS, RG-OPD), ``__call__`` scores without it."""

    name = "shell_lcc"
    reads_latents = True
    modality = "any"  # per latent position: image latents [B, C, h, w] and video latents [B, C, f, h, w] alike
    negative_scores = "it scores minus the distance to the data manifold"

    def __init__(self, path: str = DEFAULT_PATH, variant: str = "band",
                 tau: float | None = None):
        if variant not in VARIANTS:
            raise ValueError(f"shell_lcc variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        if tau is not None and not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau >= 0):
            raise ValueError(f"shell_lcc tau must be a finite number >= 0 (or null: the data's mean distance), got "
                             f"{tau!r}")
        self.path, self.variant = str(path), variant
        self.manifold, self.meta = load_manifold(path, "shell_lcc path")
        self.manifold.requires_grad_(False)
        self.tau = float(tau) if tau is not None else float(self.meta.get("data_distance", 1.0))

    @classmethod
    def check_run(cls, kwargs, *, key: str, model: str | None, image_size=None) -> None:
        """Before it is built and before the model loads (``flowalign.rewards.check_reward_run``): the manifold
        exists and was fitted for this model's VAE, else an error naming the file, ``key`` and the fix. The manifold
        is per latent position, so any image size fits."""
        path = kwargs.get("path", DEFAULT_PATH)
        meta = read_sidecar(path, f"{key}.path")
        if model is not None:
            check_fitted_for(meta, vae_fingerprint(model), path, f"{key}.path")

    def check_loaded_model(self, model: Any) -> None:
        check_fitted_for(self.meta, vae_fingerprint_of(model), self.path, "shell_lcc path")

    def forward(self, latents: Tensor, prompts: Sequence[str] | None = None,
                metadata: Sequence[dict] | None = None) -> Tensor:
        """Scores ``[B]`` of latents ``[B, C, H, W]`` (or ``[B, C, T, H, W]``), differentiable in them."""
        if next(self.manifold.parameters()).device != latents.device:
            self.manifold.to(latents.device)
        distances = self.manifold.sample_distances(latents)
        return -(distances if self.variant == "distance" else (distances - self.tau).abs())

    def __call__(self, latents: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        with torch.no_grad():
            return self.forward(latents, prompts, metadata)
