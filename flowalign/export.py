"""Export a training checkpoint's LoRA for diffusers: a LoRA folder, or a whole pipeline with the LoRA merged.

``export_lora(checkpoint, out, weights=..., merge=...)`` writes the chosen weights as a diffusers LoRA folder
(``pipe.load_lora_weights(out)``), or with ``merge`` a whole pipeline directory whose transformer has the update
``W + (alpha / r) B A`` folded into its weights (``StableDiffusion3Pipeline.from_pretrained(out)`` /
``FluxPipeline.from_pretrained(out)``, no peft needed). Its ODE samples equal the adapter's to fp32 rounding. An
existing non-empty ``out`` is refused, and the output is written to a temporary sibling and renamed into place, so no
earlier output is ever modified and an interrupted export leaves nothing half-written.

The checkpoint is found, checked and loaded by ``flowalign.lora_loading`` (every check on the paths runs before the
model loads). The LoRA-loading names this module used to hold (``resolve_lora``, ``load_model``, ...) are still
importable from here for one release, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from flowalign.deprecation import moved_names
from flowalign import lora_loading
from flowalign.lora_loading import WEIGHTS

__all__ = ["EXPORT_RECORD", "MODEL_CARD", "WEIGHTS", "check_out_dir", "export_card", "export_lora",
           "measured_before_after"]

logger = logging.getLogger(__name__)

EXPORT_RECORD = "flowalign_export.json"
MODEL_CARD = "README.md"  # the Hugging Face Hub's model card
# Names that moved to flowalign.lora_loading in 0.2: still importable from here, with a warning.
_MOVED = ("LORA_FILE", "LoraSource", "apply_lora", "base_model_path", "load_model", "resolve_lora")


def check_out_dir(out: str | os.PathLike) -> Path:
    """``out`` as a Path when it is absent or an empty directory; otherwise FileExistsError suggesting another."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        kind = "a non-empty directory" if out.is_dir() else "a file"
        suggestion = next(f"{out}-{n}" for n in range(2, 10_000) if not Path(f"{out}-{n}").exists())
        raise FileExistsError(f"--out {str(out)!r} is {kind}: nothing in it is overwritten; choose a new path, "
                              f"e.g. --out {suggestion}")
    return out


def export_lora(checkpoint: str | os.PathLike, out: str | os.PathLike, *, weights: str | None = None,
                merge: bool = False, model: str | None = None, dtype: str | None = None,
                device: str | torch.device = "cpu", repo_id: str | None = None, license: str | None = None) -> Path:
    """Write a checkpoint's ``weights`` (``ema`` / ``last``) to ``out``: a diffusers LoRA folder, or with ``merge``
    a full pipeline directory with the LoRA folded into the transformer. ``model`` overrides the checkpoint's base
    model (``model.path``), ``dtype`` its ``model.dtype``. Returns ``out``.

    Also writes ``flowalign_export.json`` (the checkpoint, the weights, the base model) and the model card
    ``README.md`` (``flowalign.model_card``; its loading snippet reads ``repo_id`` when the export goes to the hub,
    else ``out``; ``license`` replaces the base model's license fields). All checks on the paths run before the
    model loads.
    """
    source = lora_loading.resolve_lora(checkpoint, weights)
    if source.kind != "checkpoint":
        raise ValueError(f"{str(checkpoint)!r} is already a diffusers LoRA folder: `flowalign export` takes the "
                         "checkpoint directory it came from (checkpoint-NNNNNN)")
    out = check_out_dir(out)
    base = lora_loading.base_model_path(model, source)
    dtype = dtype or source.model_config.get("dtype", "fp32")
    flow_model = lora_loading.load_model(base, source, dtype=dtype, device=device)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if merge:
            flow_model.transformer.fuse_lora()  # W += (alpha / r) B A, per peft's merge
            flow_model.transformer.unload_lora()
            flow_model.pipe.save_pretrained(tmp, safe_serialization=True)
        else:
            flow_model.save_lora(tmp)
        record = {"checkpoint": str(source.path), "weights": source.weights, "merged": merge, "base_model": base,
                  "dtype": str(dtype)}
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        (tmp / MODEL_CARD).write_text(export_card(source, base, merged=merge, load_from=repo_id or str(out),
                                                  license=license), encoding="utf-8")
        out.parent.mkdir(parents=True, exist_ok=True)
        check_out_dir(out)  # again: nothing may have appeared there while the model loaded
        if out.exists():
            out.rmdir()  # empty: os.replace cannot rename onto a directory on every platform
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.debug("exported %s to %s", source.describe(), out)  # the command line says "wrote" itself
    return out


def measured_before_after(source) -> str | None:
    """The run's ``eval/before_after.md`` when it measured ``source``'s weights: the run's newest checkpoint, read
    with the weights its evaluation read (the EMA when the checkpoint has one); None otherwise."""
    table = source.path.parent / "eval" / "before_after.md"
    if not table.is_file() or lora_loading.newest_checkpoint(source.path.parent) != source.path:
        return None
    evaluated = lora_loading.resolve_lora(source.path).weights  # the default: ema when there is one, as the trainer
    return table.read_text(encoding="utf-8") if source.weights == evaluated else None


def export_card(source, base_model: str, *, merged: bool, load_from: str, license: str | None = None) -> str:
    """The model card of an export of ``source`` (``flowalign.model_card.model_card``)."""
    from flowalign.model_card import base_model_license, model_card

    fields = {"license": license} if license else base_model_license(base_model)
    return model_card(config=source.config or {}, base_model=base_model, weights=source.weights, merged=merged,
                      load_from=load_from, before_after=measured_before_after(source), license_fields=fields,
                      checkpoint=str(source.path))


# The LoRA-loading names of flowalign.export before 0.2, from flowalign.lora_loading, with a warning.
__getattr__ = moved_names(__name__, {name: f"flowalign.lora_loading:{name}" for name in _MOVED})
