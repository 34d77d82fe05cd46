"""Finding reward-model weights: a local path first, a hub download only when no local path is given.

A missing local file is the most common failure with real models, so its error says three things: the exact file
that was expected, where that file usually comes from, and the config key that points to it (in a train config a
reward's constructor arguments live under ``reward.rewards[i].kwargs``).
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["MissingWeightsError", "hub_file", "load_state_dict", "looks_local", "require_dir", "require_file"]


class MissingWeightsError(FileNotFoundError):
    """A weights file or directory is not where the configuration says it is."""


def _where(reward: str, key: str) -> str:
    return f"set it with the reward's `{key}` argument (config key reward.rewards[i].kwargs.{key} for reward {reward!r})"


def require_file(path: str | Path, *, reward: str, key: str, source: str) -> Path:
    """``path`` as a Path if it is an existing file, else MissingWeightsError naming file, source and config key."""
    resolved = Path(path).expanduser()
    if resolved.is_file():
        return resolved
    problem = "is a directory, expected a file" if resolved.is_dir() else "does not exist"
    raise MissingWeightsError(
        f"{reward}: weights file {str(resolved)!r} {problem}. It usually comes from {source}; {_where(reward, key)}."
    )


def require_dir(path: str | Path, *, reward: str, key: str, source: str, files: tuple[str, ...] = ()) -> Path:
    """``path`` as a Path if it is a directory holding ``files``; else MissingWeightsError naming the missing file."""
    resolved = Path(path).expanduser()
    if not resolved.is_dir():
        raise MissingWeightsError(
            f"{reward}: directory {str(resolved)!r} does not exist. It usually comes from {source}; "
            f"{_where(reward, key)}."
        )
    for name in files:
        if not (resolved / name).is_file():
            raise MissingWeightsError(
                f"{reward}: {str(resolved / name)!r} does not exist (the directory {str(resolved)!r} must hold "
                f"{', '.join(files)}). It usually comes from {source}; {_where(reward, key)}."
            )
    return resolved


def looks_local(name: str | Path) -> bool:
    """Whether ``name`` is meant as a local path rather than a hub id ``owner/name``.

    Absolute, ``.``/``~``-prefixed and existing paths are local, and so is ``dir/name`` when ``dir`` exists here (so a
    mistyped local model is reported as missing instead of being looked up on the hub).
    """
    text = str(name)
    path = Path(text).expanduser()
    if path.exists() or path.is_absolute() or text.startswith((".", "~")):
        return True
    parts = Path(text).parts
    return len(parts) != 2 or Path(parts[0]).is_dir()


def hub_file(repo_id: str, filename: str, *, reward: str, key: str) -> Path:
    """Download ``filename`` from the hub repository ``repo_id``; without hub access, say which local file to use."""
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id, filename))
    except Exception as error:  # offline, gated, missing: all end with the same advice
        raise MissingWeightsError(
            f"{reward}: could not fetch {filename!r} from the hub repository {repo_id!r} ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). Download {filename} where you have access and "
            f"{_where(reward, key)}."
        ) from error


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a ``.safetensors`` file or a torch file (a plain state dict, or one under ``state_dict``).

    A leading ``module.`` (DataParallel/DDP checkpoints) is stripped from the keys.
    """
    from flowalign.serialization import read_safetensors, safe_load

    if path.suffix == ".safetensors":
        state = read_safetensors(path, "a reward model's weights")
    else:
        state = safe_load(path, "a reward model's state dict")
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{str(path)!r} does not hold a state dict (got {type(state).__name__})")
    return {key.removeprefix("module."): value for key, value in state.items()}
