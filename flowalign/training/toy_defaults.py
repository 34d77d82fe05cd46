"""The toy world's reward and prompts are defaults for the toy model only.

``TrainConfig``'s defaults are the toy-world run: ``reward.rewards`` is the toy shape detector (``toy_geneval``) and
``data.train_prompts`` the toy prompts (``assets/prompts/train.jsonl``). A model preset (``configs/models/*.yaml``)
names the model and its published settings but no reward and no prompts, so a run from it that names neither would
silently train SD3.5 on "a photo of a circle", scored by the toy detector. The rule, checked by ``flowalign train``
before anything loads: a run whose ``model.path`` is not the toy model (``flowalign.embeddings.is_toy_model``) sets
both keys itself, in its config file or on the command line; the error names the missing keys and shows a complete
command line.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from flowalign.config import ConfigError

__all__ = ["WORLD_KEYS", "check_world_is_named", "example_command"]

# The keys whose defaults are the toy world's.
WORLD_KEYS = ("reward.rewards", "data.train_prompts")


def example_command(config_path: str | None, model_path: str) -> str:
    """One complete ``flowalign train`` line for ``model_path``: a reward and prompts of the user's own."""
    preset = config_path or "configs/models/sd35_medium.yaml"
    return (f"flowalign train {preset} model.path={model_path} 'reward.rewards=[{{name: pickscore}}]' "
            "data.train_prompts=my_prompts.txt")


def check_world_is_named(config: Any, keys_set: Collection[str], config_path: str | None = None) -> None:
    """ConfigError naming each of ``WORLD_KEYS`` that neither the config file nor an override set (``keys_set``:
    ``flowalign.config.set_keys``) when ``config.model.path`` is not the toy model; the toy model keeps its
    defaults. A run that never rolls out (an objective-only run: no loss term, no objective on rollouts) scores
    nothing, so it needs no reward."""
    from flowalign.embeddings import is_toy_model

    if is_toy_model(config.model.path):
        return
    parts = config.components()
    rolls_out = bool(config.loss) or any(o.trains_on_rollouts for o in parts.objectives.values())
    missing = [key for key in WORLD_KEYS if key not in keys_set and (rolls_out or key != "reward.rewards")]
    if not missing:
        return
    defaults = {"reward.rewards": "the toy shape detector (toy_geneval)",
                "data.train_prompts": "the toy prompts (assets/prompts/train.jsonl)"}
    named = " and ".join(missing)
    raise ConfigError(
        f"{named} {'are' if len(missing) > 1 else 'is'} not set, and model.path = {config.model.path!r} is not the "
        f"toy model: the default{'s' if len(missing) > 1 else ''} ({', '.join(defaults[k] for k in missing)}) "
        f"belong{'' if len(missing) > 1 else 's'} to the toy world only. Name the reward and the prompts to train "
        f"on, e.g.: {example_command(config_path, config.model.path)}", key=missing[0])
