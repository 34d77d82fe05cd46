"""A trained LoRA outside the trainer: find it, check it, and load it into a model for sampling or evaluation.

A LoRA source (``resolve_lora``) is one of two directories that ``flowalign train`` writes:

* a **checkpoint** ``checkpoint-NNNNNN/`` (``flowalign.training.checkpoint_files``), with ``trainable.safetensors``
  (the last weights), ``ema.safetensors`` (their EMA, when ``optim.ema_decay > 0``) and the run's ``config.yaml``.
  ``weights`` picks ``"ema"`` or ``"last"`` (default: ``ema`` when the checkpoint has it). Loading re-creates the
  trainer's adapter exactly: ``FlowModel.add_lora`` with the config's ``model.lora_rank`` / ``lora_alpha`` /
  ``lora_targets``, LoRA parameters in fp32 as the trainer keeps them, then every tensor copied in by parameter name.
  This is bitwise the model that the trainer's final evaluation samples (``flowalign.training.evaluation.evaluate_before_after`` swaps
  the EMA into the same parameters), so ``flowalign eval toy --lora CHECKPOINT`` with the run's evaluation settings
  reproduces its "after" column exactly.
* a **diffusers LoRA folder** (``pytorch_lora_weights.safetensors``, e.g. a checkpoint's ``lora/``, which holds the
  *last* weights, or the output of ``flowalign.export.export_lora``). It is loaded with the pipeline's own
  ``load_lora_weights``, after a check that every LoRA layer names a linear module of the transformer with matching
  sizes. Its samples equal those of the checkpoint's weights to fp32 tolerance (in practice bitwise for an fp32 model;
  with a bf16/fp16 base, diffusers keeps the adapter in the base dtype where the trainer keeps it in fp32).

The base model is ``--model`` when given, else the checkpoint's ``model.path`` (``base_model_path``), checked by
``resolve_model_path`` (a local-looking path must exist; ``assets/toy-sd3`` is also looked up in the repository).

Every check on the paths runs before a model loads (``resolve_lora``); a LoRA that does not fit the model is an error
naming both before anything is sampled (``apply_lora``). Writing a LoRA out for diffusers is ``flowalign.export``.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads when a model does: the command line's --help reads WEIGHTS from here
    import torch

__all__ = ["DEFAULT_MODEL", "LORA_FILE", "WEIGHTS", "LoraSource", "apply_lora", "base_model_path", "load_model",
           "resolve_lora", "resolve_model_path"]

logger = logging.getLogger(__name__)

WEIGHTS = ("ema", "last")
LORA_FILE = "pytorch_lora_weights.safetensors"
_WEIGHT_FILES = {"ema": "ema.safetensors", "last": "trainable.safetensors"}
_CHECKPOINT_NAME = re.compile(r"^checkpoint-\d+$")
# diffusers' LoRA keys: "transformer.<module path>.lora_A.weight" (down, [r, in]) / "lora_B.weight" (up, [out, r]).
_LORA_KEY = re.compile(r"^transformer\.(?P<module>.+)\.lora_(?P<side>[AB])\.weight$")
DEFAULT_MODEL = "assets/toy-sd3"  # the toy world's model: looked up in the repository too


@dataclass(frozen=True)
class LoraSource:
    """A checked LoRA directory: ``kind`` is ``"checkpoint"`` or ``"lora"`` (a diffusers LoRA folder).

    ``weights`` is ``"ema"`` or ``"last"`` for a checkpoint, None for a LoRA folder; ``config`` is the checkpoint's
    ``config.yaml`` as a dict (None for a LoRA folder).
    """

    path: Path
    kind: str
    weights: str | None = None
    config: dict | None = None

    @property
    def tensors_file(self) -> Path:
        """The safetensors file that holds the chosen weights (a sharded checkpoint's are in ``sharded/``)."""
        if self.kind == "checkpoint":
            return self.path / _WEIGHT_FILES[self.weights]
        return self.path / LORA_FILE

    @property
    def sharded(self) -> bool:
        return self.kind == "checkpoint" and (self.path / "sharded").is_dir()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The chosen weights by parameter name: the safetensors file, or a sharded checkpoint's part (read without
        running anything from it: ``flowalign.serialization``); a damaged or refused file is a ValueError naming it."""
        from flowalign.serialization import read_safetensors
        from flowalign.sharded_reading import read_sharded

        if self.sharded:
            return read_sharded(self.path / "sharded", "trainable" if self.weights == "last" else "ema")
        return read_safetensors(self.tensors_file, f"the {self.weights} weights of a checkpoint")

    @property
    def model_config(self) -> dict:
        return dict((self.config or {}).get("model") or {})

    @property
    def model_path(self) -> str | None:
        """The base model the checkpoint was trained on (its ``model.path``); None for a LoRA folder."""
        return self.model_config.get("path")

    def describe(self) -> str:
        if self.kind == "checkpoint":
            return f"checkpoint {self.path} ({self.weights} weights)"
        return f"LoRA folder {self.path}"

    def record(self) -> dict[str, Any]:
        """What to store next to results made with this LoRA."""
        return {"path": str(self.path), "kind": self.kind, "weights": self.weights}


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The highest-numbered ``checkpoint-NNNNNN`` folder of a run directory, or None."""
    found = [p for p in run_dir.iterdir() if p.is_dir() and _CHECKPOINT_NAME.match(p.name)] if run_dir.is_dir() else []
    return max(found, key=lambda p: int(p.name.split("-")[1]), default=None)


def resolve_lora(path: str | os.PathLike, weights: str | None = None) -> LoraSource:
    """Check ``path`` and ``weights`` without loading anything; FileNotFoundError / ValueError name what is wrong.

    ``path`` is a checkpoint directory (``trainable.safetensors`` + ``config.yaml``) or a diffusers LoRA folder
    (``pytorch_lora_weights.safetensors``). ``weights`` (``"ema"`` or ``"last"``) applies to a checkpoint only;
    None picks ``ema`` when the checkpoint has ``ema.safetensors``, else ``last``.
    """
    import yaml

    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    directory = Path(path).expanduser()
    if not directory.exists():
        raise FileNotFoundError(f"LoRA path {str(path)!r} does not exist: give a checkpoint directory "
                                f"(checkpoint-NNNNNN of a `flowalign train` run) or a LoRA folder with {LORA_FILE}")
    if not directory.is_dir():
        raise NotADirectoryError(f"LoRA path {str(path)!r} is a file, not a directory: give the checkpoint directory "
                                 f"or the folder that holds {LORA_FILE}")
    sharded = (directory / "sharded").is_dir()
    if (directory / "transformer").is_dir() and (directory / "state.json").is_file():
        raise ValueError(f"{str(path)!r} is a checkpoint of a full fine-tune (model.finetune: full): it holds no LoRA; "
                         f"its trained transformer is {str(directory / 'transformer')!r} (diffusers format): put it in "
                         "a copy of the base pipeline directory in place of transformer/ and pass that as --model")
    if (directory / "trainable.safetensors").is_file() or sharded:
        config_file = directory / "config.yaml"
        if not config_file.is_file():
            raise FileNotFoundError(f"checkpoint {str(path)!r} has no config.yaml: it cannot say which LoRA rank, "
                                    "alpha and target modules its weights belong to (its lora/ folder can be given "
                                    "instead)")
        config = yaml.safe_load(config_file.read_text()) or {}
        ema_decay = (config.get("optim") or {}).get("ema_decay") if isinstance(config, dict) else None
        if sharded:  # its .metadata is read (allow-listed: flowalign.sharded_reading) before a model loads
            from flowalign.sharded_reading import holds_part

            has_ema = holds_part(directory / "sharded", "ema")
        else:
            has_ema = (directory / _WEIGHT_FILES["ema"]).is_file()
        ema_file = directory / ("sharded/.metadata" if sharded else _WEIGHT_FILES["ema"])
        if weights is None and ema_decay and not has_ema:  # the run kept an EMA, and its file is gone
            gone = "lists no EMA (ema.*)" if sharded else "is missing"
            raise ValueError(f"{str(ema_file)!r} {gone}, but checkpoint {str(path)!r} was trained with "
                             f"optim.ema_decay = {ema_decay}: its EMA is gone. Pass --weights last for its last "
                             "weights, or restore the file")
        if weights is None:
            weights = "ema" if has_ema else "last"
        elif weights == "ema" and not has_ema:
            raise ValueError(f"checkpoint {str(path)!r} has no ema.safetensors (trained with optim.ema_decay=0): "
                             "use --weights last")
        return LoraSource(directory, "checkpoint", weights, config)
    if (directory / LORA_FILE).is_file():
        if weights is not None:
            note = " (a checkpoint's lora/ folder holds its last weights)" if directory.name == "lora" else ""
            raise ValueError(f"--weights {weights} chooses the weights of a checkpoint directory, but {str(path)!r} is "
                             f"a LoRA folder{note}: give the checkpoint directory itself, or drop --weights")
        return LoraSource(directory, "lora")
    checkpoints = sorted(p.name for p in directory.iterdir() if p.is_dir() and _CHECKPOINT_NAME.match(p.name))
    hint = (f"; it looks like a run directory: pass one of its checkpoints, e.g. {str(directory / checkpoints[-1])!r}"
            if checkpoints else "")
    raise FileNotFoundError(f"LoRA path {str(path)!r} is neither a checkpoint directory (trainable.safetensors and "
                            f"config.yaml) nor a LoRA folder ({LORA_FILE}){hint}")


def resolve_model_path(model: str) -> str:
    """The model to load, with a clear FileNotFoundError for a local-looking path that does not exist.

    The default ``assets/toy-sd3`` is always local: relative to the working directory, else to the repository (as
    ``assets/prompts`` is). Any other relative ``dir/name`` is also what a hub id looks like; it counts as local
    when ``dir`` exists here, so a missing local model is not looked up on the hub.
    """
    path = Path(model).expanduser()
    if path.exists():
        return model
    if model == DEFAULT_MODEL:
        from flowalign.toy.prompts import PROMPT_ASSET_DIR

        in_repo = Path(PROMPT_ASSET_DIR).parents[1] / DEFAULT_MODEL
        if in_repo.exists():
            return str(in_repo)
        raise FileNotFoundError(
            f"model path {model!r} does not exist here nor at {str(in_repo)!r} (build it with `flowalign toy pretrain`)"
        )
    parent = path.parent
    if path.is_absolute() or model.startswith((".", "~")) or (str(parent) != "." and parent.is_dir()):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    return model  # a hub id: load_flow_model fetches it or explains why it cannot


def base_model_path(model: str | None, lora: LoraSource | None, default: str | None = None) -> str:
    """The base model to load, checked by ``resolve_model_path``: ``model`` when given, else the checkpoint's
    ``model.path``, else ``default``; FileNotFoundError / ValueError say which one is missing."""
    from_checkpoint = model is None and lora is not None and lora.kind == "checkpoint" and bool(lora.model_path)
    chosen = model if model is not None else lora.model_path if from_checkpoint else default
    if chosen is None:
        what = f"{lora.describe()} does not name its base model" if lora is not None else "no model given"
        raise ValueError(f"{what}: pass --model")
    try:
        return resolve_model_path(chosen)
    except FileNotFoundError as error:
        if from_checkpoint:
            raise FileNotFoundError(f"{error}: it is the model.path of {lora.describe()}; pass --model with the base "
                                    "model's directory") from None
        raise


def load_model(model_path: str, lora: LoraSource | None = None, *, dtype: str | torch.dtype = "fp32",
               device: str | torch.device = "cpu"):
    """``load_flow_model(model_path)`` with ``lora`` applied (``apply_lora``); a checkpoint's
    ``model.max_sequence_length`` is used as in training. ``model_path`` as ``base_model_path`` returns it."""
    from flowalign.models.loading import load_flow_model

    max_length = lora.model_config.get("max_sequence_length") if lora is not None else None
    model = load_flow_model(model_path, dtype=dtype, device=device, max_sequence_length=max_length)
    if lora is not None:
        apply_lora(model, lora, model_name=model_path)
    return model


def apply_lora(model, lora: LoraSource, *, model_name: str | None = None) -> None:
    """Attach ``lora`` to ``model``'s transformer; ValueError naming both when it does not fit (nothing is sampled)."""
    what = model_name or type(model.transformer).__name__
    if model.has_lora:
        raise ValueError(f"model {what} already has a LoRA adapter: load {lora.describe()} into a fresh model")
    if lora.kind == "lora":
        _check_lora_folder(model, lora, what)
        loader = getattr(model, "load_lora_folder", None)  # a model of several experts loads each one's file
        if loader is None:
            model.pipe.load_lora_weights(str(lora.path))
        else:
            loader(lora.path)
        return
    cfg = lora.model_config
    family = cfg.get("family")
    if family is not None and family != model.family:
        raise ValueError(f"{lora.describe()} was trained on a {family!r} model, but {what} is {model.family!r}")
    targets = cfg.get("lora_targets")
    try:
        experts = cfg.get("lora_experts")  # the experts a Wan2.2 A14B LoRA was trained on
        model.add_lora(rank=int(cfg.get("lora_rank", 8)), alpha=float(cfg.get("lora_alpha", 16.0)),
                       target_modules=targets, **({} if experts is None else {"experts": experts}))
    except ValueError as error:
        raise ValueError(f"{lora.describe()} does not fit {what}: {error}") from None
    params = {name: p for name, p in model.transformer.named_parameters() if "lora_" in name}
    saved = lora.tensors()
    missing, unexpected = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
    wrong = [f"{name} {tuple(saved[name].shape)} vs {tuple(params[name].shape)}"
             for name in sorted(set(params) & set(saved)) if saved[name].shape != params[name].shape]
    if missing or unexpected or wrong:
        model.transformer.unload_lora()  # leave the model as it was
        raise ValueError(f"{lora.describe()} does not fit {what}: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                         f"wrong shapes {wrong[:3]} (was it trained on another base model? pass that one as --model)")
    import torch

    with torch.no_grad():
        for name, param in params.items():
            param.data = param.data.float()  # LoRA weights live in fp32 whatever the base dtype, as in the trainer
            param.copy_(saved[name])


def _check_lora_folder(model, lora: LoraSource, what: str) -> None:
    """Every transformer LoRA layer of the folder names a linear module of ``model`` with matching sizes."""
    import torch

    from safetensors import safe_open

    modules = dict(getattr(model.transformer, "high", model.transformer).named_modules())  # Wan2.2: the experts
    # share one architecture, so the high expert's modules are the ones a folder's layers must name
    from safetensors import SafetensorError

    from flowalign.serialization import damaged

    layers = problems = 0
    found: list[str] = []
    try:
        handle = safe_open(str(lora.tensors_file), framework="pt")
    except SafetensorError as error:
        raise damaged(lora.tensors_file, "a diffusers LoRA file", error) from None
    with handle:
        for key in handle.keys():
            match = _LORA_KEY.match(key)
            if match is None:
                continue
            layers += 1
            shape = tuple(handle.get_slice(key).get_shape())
            module = modules.get(match["module"])
            if not isinstance(module, torch.nn.Linear):
                problem = f"{match['module']} is not a linear module of the transformer"
            elif match["side"] == "A" and shape[1] != module.in_features:
                problem = f"{key} is {shape}, but the layer takes {module.in_features} inputs"
            elif match["side"] == "B" and shape[0] != module.out_features:
                problem = f"{key} is {shape}, but the layer has {module.out_features} outputs"
            else:
                continue
            problems += 1
            if len(found) < 3:
                found.append(problem)
    if layers == 0:
        raise ValueError(f"{lora.describe()} holds no transformer LoRA weights (keys transformer.*.lora_A/B.weight)")
    if problems:
        raise ValueError(f"{lora.describe()} does not fit {what}: {problems} of its {layers} LoRA tensors do not match "
                         f"({'; '.join(found)}); was it trained on another base model? pass that one as --model")
