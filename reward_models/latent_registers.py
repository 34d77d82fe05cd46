"""Latent reward registers: learnable tokens that read a frozen SD3/FLUX transformer's hidden states and score x_t.

Reference: docs/design/math.md#registers; the register idea follows Darcet et al. 2024, "Vision
Transformers Need Registers", used here as an auxiliary *read* path of a frozen DiT.

``N`` register tokens ``R in R^{N x d}`` (default ``N = 32``) read the token sequence (text + image) that leaves
chosen transformer blocks, the *taps* (default: 3 evenly spaced blocks). At tap ``k``, with the block's output
tokens ``H_k`` and a sigma embedding ``e(s)``:

    R <- R + e_k(s)
    R <- R + CrossAttn(LN(R), LN(H_k))          (queries from the registers, keys/values from the tokens)
    R <- R + MLP(LN(R))
    z_k = mean over registers of R

and each reward head ``h`` is ``LayerNorm -> MLP`` on ``[z_1, ..., z_K]``. This is what registers appended to the
sequence under a one-way attention mask compute (the registers attend to the tokens, the tokens never attend to the
registers), built as forward hooks that only *read* the blocks' outputs: the generator's hidden states and velocity
are bitwise those of the model without registers (tests/test_registers.py), and one transformer pass yields both
the velocity and the register scores. Gradients reach ``x_t`` through the tapped hidden states, which RGS uses.

Training (``flowalign.prep.train_registers``) uses the pairwise Thurstone loss on noisy latents of one prompt
(docs/design/math.md#registers): with scores ``r_i, r_j`` of two states at sigma ``s`` whose final images got rewards
``y_i != y_j``,

    v = 2 s^2 + 0.05,   p = Phi(sign(y_i - y_j) (r_i - r_j) / sqrt(v_i + v_j)),   loss = 1 - sqrt(p).

The variance grows with the noise level, so pairs that noise makes hard to tell apart are pushed less.

A checkpoint stores the register weights, their settings and the transformer config they were trained on;
``load_registers`` refuses one from a different transformer config. It is read with ``torch.load(weights_only=True)``
(``flowalign.serialization.safe_load``): a file that would run code while unpickling is refused, naming the file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from flowalign.serialization import safe_load

__all__ = [
    "LatentRegisters",
    "SIGMA_BANDS",
    "check_transformer_config",
    "default_taps",
    "load_registers",
    "pairwise_accuracy",
    "sigma_band",
    "thurstone_loss",
    "thurstone_variance",
    "transformer_layers",
]

# (label, low, high]: register accuracy is reported per band.
SIGMA_BANDS = (("sigma>0.8", 0.8, 1.0), ("0.5-0.8", 0.5, 0.8), ("0.2-0.5", 0.2, 0.5), ("sigma<0.2", -1.0, 0.2))


def transformer_layers(transformer: nn.Module) -> list[nn.Module]:
    """The blocks registers can tap, in order: SD3's ``transformer_blocks``; FLUX's double- then single-stream; a
    video DiT's ``blocks`` (Wan: one token stream over every latent frame's patches)."""
    layers = list(getattr(transformer, "transformer_blocks", [])) + list(getattr(transformer, "single_transformer_blocks", []))
    if not layers:
        layers = list(getattr(transformer, "blocks", []))
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no transformer_blocks (or blocks): registers need an SD3, "
                         "FLUX or Wan DiT")
    return layers


def default_taps(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """``count`` evenly spaced block indices ending at the last block (e.g. 24 blocks -> 7, 15, 23)."""
    count = min(count, num_layers)
    return tuple(sorted({round((i + 1) * num_layers / count) - 1 for i in range(count)}))


def comparable_config(config) -> dict:
    """A transformer config without diffusers' private keys (``_name_or_path`` etc.), JSON-friendly."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(config).items() if not k.startswith("_")}


def check_transformer_config(saved: dict, actual: dict, where: str = "register checkpoint") -> None:
    """ValueError naming every key where ``saved`` and ``actual`` transformer configs differ (keys only one side has
    are defaults of another diffusers version and are not compared)."""
    actual = comparable_config(actual)
    keys = sorted(set(saved) & set(actual))
    diff = [f"{k}: {saved.get(k, '(missing)')!r} vs {actual.get(k, '(missing)')!r}" for k in keys
            if saved.get(k) != actual.get(k)]
    if diff:
        raise ValueError(
            f"{where} was trained on a different transformer config (checkpoint vs this model): {'; '.join(diff)}. "
            "Registers read one transformer's hidden states; train registers for this model with "
            "`flowalign prep registers --model PATH`"
        )


class SigmaEmbedding(nn.Module):
    """Sinusoidal features of ``1000 s`` (the pipelines' timestep) through a linear map."""

    def __init__(self, width: int, frequencies: int = 32):
        super().__init__()
        self.register_buffer("freqs", torch.exp(-math.log(1e4) * torch.arange(frequencies) / frequencies), persistent=False)
        self.proj = nn.Linear(2 * frequencies, width)

    def forward(self, sigma: Tensor) -> Tensor:
        angles = 1000 * sigma.float()[:, None] * self.freqs
        return self.proj(torch.cat([angles.sin(), angles.cos()], dim=-1))


class RegisterRead(nn.Module):
    """One tap: sigma embedding, cross-attention from the registers to the tokens, then an MLP (pre-LN residuals)."""

    def __init__(self, width: int, token_width: int, heads: int):
        super().__init__()
        self.sigma = SigmaEmbedding(width)
        self.norm_tokens = nn.LayerNorm(token_width)
        self.norm_query = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, kdim=token_width, vdim=token_width, batch_first=True)
        self.norm_mlp = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, registers: Tensor, tokens: Tensor, sigma: Tensor) -> Tensor:
        registers = registers + self.sigma(sigma)[:, None]
        tokens = self.norm_tokens(tokens.float())
        registers = registers + self.attn(self.norm_query(registers), tokens, tokens, need_weights=False)[0]
        return registers + self.mlp(self.norm_mlp(registers))


class LatentRegisters(nn.Module):
    """Register tokens, one read per tap and one ``LayerNorm -> MLP`` head per reward (module docstring).

    ``token_width`` is the transformer's hidden size, ``num_layers`` its number of tappable blocks. Use
    ``attach(transformer)`` to install the read hooks, then ``read(velocity, x, sigma, ...)`` for ``(v, scores)``
    from one pass, or ``features_to_scores`` on captured features.
    """

    def __init__(self, token_width: int, num_layers: int, *, heads: Sequence[str] = ("reward",),
                 num_registers: int = 32, width: int = 128, attention_heads: int = 4,
                 taps: Sequence[int] | None = None, transformer_config: dict | None = None):
        super().__init__()
        taps = tuple(default_taps(num_layers) if taps is None else (int(t) for t in taps))
        if not taps or any(t < 0 or t >= num_layers for t in taps) or list(taps) != sorted(set(taps)):
            raise ValueError(f"register taps must be increasing block indices in 0..{num_layers - 1}, got {list(taps)}")
        if num_registers < 1 or width % attention_heads:
            raise ValueError(f"need num_registers >= 1 and width divisible by attention_heads, got {num_registers}, "
                             f"{width}, {attention_heads}")
        if not heads or len(set(heads)) != len(heads):
            raise ValueError(f"register heads must be distinct reward names, got {list(heads)}")
        self.settings = {"token_width": token_width, "num_layers": num_layers, "heads": list(heads),
                         "num_registers": num_registers, "width": width, "attention_heads": attention_heads,
                         "taps": list(taps)}
        self.transformer_config = transformer_config or {}
        self.taps = taps
        self.head_names = list(heads)
        self.registers = nn.Parameter(torch.randn(num_registers, width) * 0.02)
        self.reads = nn.ModuleList(RegisterRead(width, token_width, attention_heads) for _ in taps)
        pooled = width * len(taps)
        self.heads = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(pooled), nn.Linear(pooled, width), nn.GELU(), nn.Linear(width, 1))
            for _ in heads
        )
        self._hooks: list = []
        self.captured: dict[int, Tensor] = {}

    # --- reading a transformer ----------------------------------------------------------------------------------
    def attach(self, transformer: nn.Module) -> "LatentRegisters":
        """Install read-only forward hooks on the tap blocks (replacing earlier ones)."""
        self.detach()
        layers = transformer_layers(transformer)
        if self.transformer_config:
            check_transformer_config(self.transformer_config, transformer.config)
        if len(layers) != self.settings["num_layers"]:
            raise ValueError(f"registers were built for {self.settings['num_layers']} blocks, the transformer has "
                             f"{len(layers)}")
        for tap in self.taps:
            self._hooks.append(layers[tap].register_forward_hook(self._capture(tap)))
        return self

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.captured = [], {}

    def _capture(self, tap: int):
        def hook(module, args, output):
            parts = output if isinstance(output, tuple) else (output,)
            # Blocks return (text, image) token streams; the text stream is None after SD3's last block.
            self.captured[tap] = torch.cat([p for p in parts if isinstance(p, Tensor) and p.ndim == 3], dim=1)

        return hook

    def take_features(self, batch: int) -> list[Tensor]:
        """The tokens captured by the last forward pass, one ``[batch, L, D]`` tensor per tap (the conditional half
        when CFG doubled the batch)."""
        missing = [t for t in self.taps if t not in self.captured]
        if missing:
            raise RuntimeError(f"no hidden states captured at taps {missing}: call attach(transformer) and run a forward")
        features = [self.captured[t][-batch:] for t in self.taps]
        self.captured = {}
        return features

    # --- scores -------------------------------------------------------------------------------------------------
    def features_to_scores(self, features: Sequence[Tensor], sigma: Tensor) -> Tensor:
        """Scores ``[B, heads]`` from tapped tokens (one ``[B, L, D]`` per tap) at sigmas ``[B]`` (or a scalar)."""
        batch = features[0].shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=features[0].device).reshape(-1).expand(batch)
        registers = self.registers[None].expand(batch, -1, -1)
        pooled = []
        for read, tokens in zip(self.reads, features):
            registers = read(registers, tokens, sigma)
            pooled.append(registers.mean(dim=1))
        z = torch.cat(pooled, dim=-1)
        return torch.cat([head(z) for head in self.heads], dim=-1)

    def read(self, velocity: Callable[..., Tensor], x: Tensor, sigma: Tensor, *args) -> tuple[Tensor, Tensor]:
        """``(v, scores [B, heads])`` from one pass of ``velocity(x, sigma, *args)`` through the attached
        transformer."""
        v = velocity(x, sigma, *args)
        return v, self.features_to_scores(self.take_features(x.shape[0]), sigma)

    def guide(self, velocity: Callable[..., Tensor]):
        """An RGS guide ``(x, sigma, rows) -> (v, scores)`` sharing the transformer pass (``samplers.rgs``)."""

        def guide(x: Tensor, sigma: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
            return self.read(velocity, x, sigma, rows)

        guide.evals_per_sample = getattr(velocity, "evals_per_sample", 1)
        return guide

    # --- checkpoints --------------------------------------------------------------------------------------------
    def save(self, path: str | Path, extra: dict | None = None) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"settings": self.settings, "transformer_config": self.transformer_config,
                    "state_dict": self.state_dict(), "extra": extra or {}}, path)
        return path

    @classmethod
    def for_transformer(cls, transformer: nn.Module, **kwargs) -> "LatentRegisters":
        """Registers sized for ``transformer`` (its hidden size and block count), remembering its config."""
        layers = transformer_layers(transformer)
        config = transformer.config
        token_width = config.num_attention_heads * config.attention_head_dim
        return cls(token_width, len(layers), transformer_config=comparable_config(config), **kwargs)


def read_checkpoint(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"register checkpoint {str(path)!r} does not exist (train one with "
                                "`flowalign prep registers`)")
    blob = safe_load(path, "a register checkpoint")
    if not isinstance(blob, dict) or "settings" not in blob or "state_dict" not in blob:
        raise ValueError(f"{path} is not a register checkpoint (no settings/state_dict)")
    return blob


def load_registers(path: str | Path, transformer_config: dict | None = None) -> LatentRegisters:
    """Registers from a checkpoint; with ``transformer_config``, a ValueError first when it is not the one they were
    trained on (checked before any weights are built)."""
    blob = read_checkpoint(path)
    if transformer_config is not None:
        check_transformer_config(blob["transformer_config"], transformer_config, f"register checkpoint {path}")
    settings = dict(blob["settings"])
    registers = LatentRegisters(settings.pop("token_width"), settings.pop("num_layers"),
                                transformer_config=blob["transformer_config"], **settings)
    registers.load_state_dict(blob["state_dict"])
    return registers


# --- the loss and the metric ------------------------------------------------------------------------------------


def thurstone_variance(sigma: Tensor) -> Tensor:
    """``v = 2 s^2 + 0.05``: the score noise a state at sigma ``s`` is allowed."""
    return 2 * sigma.float() ** 2 + 0.05


def thurstone_loss(r_i: Tensor, r_j: Tensor, y_i: Tensor, y_j: Tensor, sigma_i: Tensor, sigma_j: Tensor) -> Tensor:
    """Mean of ``1 - sqrt(Phi(sign(y_i - y_j)(r_i - r_j) / sqrt(v_i + v_j)))`` over pairs with ``y_i != y_j``
    (0 when there is none)."""
    sign = torch.sign(torch.as_tensor(y_i, dtype=torch.float32) - torch.as_tensor(y_j, dtype=torch.float32))
    keep = sign != 0
    if not keep.any():
        return r_i.sum() * 0.0
    z = sign * (r_i - r_j) / torch.sqrt(thurstone_variance(sigma_i) + thurstone_variance(sigma_j))
    p = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    return (1 - torch.sqrt(p.clamp_min(1e-12)))[keep].mean()


def sigma_band(sigma: float) -> str:
    for label, low, high in SIGMA_BANDS:
        if low < sigma <= high:
            return label
    raise ValueError(f"sigma {sigma} lies outside [0, 1]")


def pairwise_accuracy(scores: Tensor, labels: Tensor, groups: Tensor, sigmas: Tensor) -> dict[str, dict]:
    """Per sigma band: the fraction of pairs (same group, same sigma, different labels) that ``scores`` order like
    ``labels`` (a tie in scores counts half), and the number of pairs."""
    scores, labels = scores.double().flatten(), labels.double().flatten()
    groups, sigmas = torch.as_tensor(groups).flatten(), sigmas.double().flatten()
    same = (groups[:, None] == groups[None]) & (sigmas[:, None] == sigmas[None])
    upper = torch.triu(torch.ones_like(same), diagonal=1)
    dy = torch.sign(labels[:, None] - labels[None])
    dr = torch.sign(scores[:, None] - scores[None])
    pairs = same & upper & (dy != 0)
    right = torch.where(dr == dy, 1.0, torch.where(dr == 0, 0.5, 0.0))
    out = {}
    for label, low, high in SIGMA_BANDS:
        band = pairs & ((sigmas > low) & (sigmas <= high))[:, None]
        count = int(band.sum())
        out[label] = {"accuracy": float(right[band].mean()) if count else math.nan, "pairs": count}
    return out
