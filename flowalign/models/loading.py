"""Load a FlowModel from a local directory or a hub id, or wrap a pipeline already in memory.

The built-in families are registered by the package (``flowalign/models/__init__.py`` imports every family module,
and Python runs it before any of its submodules is used), so this module imports only the registry.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..devices import resolve_dtype
from .base import MODEL_FAMILIES, FlowModel

ADAPTERS = MODEL_FAMILIES  # the registered adapters by family name


def _candidates(class_name: str) -> list[type[FlowModel]]:
    """The registered adapters of pipeline class ``class_name``."""
    return [MODEL_FAMILIES.get(name) for name in MODEL_FAMILIES
            if MODEL_FAMILIES.get(name).pipeline_class_name == class_name]


def _adapter_for(class_name: str, index: dict, where: str) -> type[FlowModel]:
    """The adapter that claims a ``class_name`` pipeline with config ``index`` most (``FlowModel.claims``)."""
    claims = [(adapter.claims(index), adapter) for adapter in _candidates(class_name)]
    claims = [(score, adapter) for score, adapter in claims if score > 0]
    if not claims:
        raise _unsupported(class_name, where)
    return max(claims, key=lambda pair: pair[0])[1]


def _unsupported(class_name: str, where: str) -> ValueError:
    families = ", ".join(f"{name} ({MODEL_FAMILIES.get(name).pipeline_class_name})" for name in MODEL_FAMILIES)
    return ValueError(f"pipeline class {class_name!r} ({where}) is not one flowalign has an adapter for: the model "
                      f"families are {families} (register another with flowalign.models.register_model_family)")


def wrap_pipeline(pipe, **kwargs) -> FlowModel:
    """The adapter for a diffusers pipeline object (its class, or a base class, names a registered family; among the
    families of one pipeline class, the one that claims its config)."""
    for cls in type(pipe).__mro__:
        if _candidates(cls.__name__):
            return _adapter_for(cls.__name__, dict(pipe.config), "object passed to wrap_pipeline")(pipe, **kwargs)
    raise _unsupported(type(pipe).__name__, "object passed to wrap_pipeline")


def _looks_like_local_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") != 1 or Path(name).suffix != ""


def model_index(path_or_id: str) -> dict:
    """A model's ``model_index.json`` (read locally, or fetched for a hub id): its ``_class_name`` and components."""
    local = Path(path_or_id).expanduser()
    if local.is_dir():
        index = local / "model_index.json"
        if not index.is_file():
            raise FileNotFoundError(
                f"{local} has no model_index.json: point to a diffusers pipeline directory (saved with save_pretrained)"
            )
        return json.loads(index.read_text())
    if local.exists() or _looks_like_local_path(path_or_id):
        raise FileNotFoundError(
            f"model path {path_or_id!r} does not exist: give a local diffusers pipeline directory "
            "or a hub id such as 'stabilityai/stable-diffusion-3.5-medium'"
        )
    from diffusers import DiffusionPipeline

    try:
        return dict(DiffusionPipeline.load_config(path_or_id))
    except Exception as error:  # no network, unknown repo, gated repo ...
        raise FileNotFoundError(
            f"model {path_or_id!r} is not a local directory and could not be fetched from the hub ({error}); "
            "download it first and pass the local path"
        ) from error


def pipeline_class_name(path_or_id: str) -> str:
    """The ``_class_name`` in a model's ``model_index.json`` (read locally, or fetched for a hub id)."""
    return model_index(path_or_id)["_class_name"]


def adapter_class(path_or_id: str | Path, family: str | None = None) -> type[FlowModel]:
    """The adapter a model loads with, loading no weights: the registered ``family``, else the one of the pipeline
    class its ``model_index.json`` names."""
    if family is not None:
        return MODEL_FAMILIES.get(family)
    index = model_index(str(path_or_id))
    return _adapter_for(index["_class_name"], index, f"from {path_or_id}/model_index.json")


def names_adapter(path_or_id: str | Path, family: str | None = None) -> bool:
    """Whether ``adapter_class`` can answer without the hub: a family is given, or ``path_or_id`` is a local folder
    with a ``model_index.json``."""
    return family is not None or (Path(str(path_or_id)).expanduser() / "model_index.json").is_file()


def load_flow_model(
    path_or_id: str | Path,
    *,
    family: str | None = None,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_sequence_length: int | None = None,
    adapter_options: dict | None = None,
    **pipeline_kwargs,
) -> FlowModel:
    """Load a pipeline of a registered model family with ``from_pretrained`` and wrap it.

    ``family`` (a registered name: "sd3", "flux", ...) must agree with the pipeline class in ``model_index.json`` when given.

    Args:
        path_or_id: a local pipeline folder (with ``model_index.json``) or a hub id.
        family: the registered family to expect; None picks it from the pipeline class in ``model_index.json``.
        dtype: the pipeline's dtype (a torch dtype or its name: "float32", "bfloat16", ...).
        device: where the pipeline is moved.
        max_sequence_length: the text encoders' token limit; None is the family's default.
        adapter_options: further keyword arguments of the family's adapter (a video family's ``num_frames``,
            ``decode_batch``, ``vae_tiling``).
        **pipeline_kwargs: passed on to the pipeline class's ``from_pretrained``.

    Returns:
        The family's ``FlowModel`` wrapping the loaded pipeline.
    """
    path_or_id = str(path_or_id)
    index = model_index(path_or_id)
    class_name = index["_class_name"]
    adapter = _adapter_for(class_name, index, f"from {path_or_id}/model_index.json")
    if family is not None:
        if MODEL_FAMILIES.get(family) is not adapter:  # an unknown family: a ValueError with a did-you-mean
            raise ValueError(f"model {path_or_id!r} is a {class_name}, not a {family!r} model")
    import diffusers
    from diffusers.utils import deprecation_utils

    from flowalign.console import loading_quietly

    pipeline_class = getattr(diffusers, class_name)
    # the weights' dtype under the name this diffusers takes: `dtype` where `torch_dtype` is deprecated (0.42 on)
    dtype_key = "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"
    with loading_quietly():
        pipe = pipeline_class.from_pretrained(path_or_id, **{dtype_key: resolve_dtype(dtype)}, **pipeline_kwargs)
    pipe.set_progress_bar_config(disable=True)
    return adapter(pipe.to(device), max_sequence_length=max_sequence_length, **(adapter_options or {}))
