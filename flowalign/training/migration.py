"""Config keys from before the component redesign, moved to the components they belong to.

Every YAML layer and override of a ``TrainConfig`` passes through ``migrate_layer`` before its keys are checked, so an
old config file, an old command line and an old checkpoint's ``config.yaml`` still load (with a one-line notice
naming the moved keys). The moves:

    rollout.shape                                    -> rollout.name
    rollout.fusion / width_prune / width_prune_fraction / depth_prune_steps / depth_prune_sliding
                                                     -> credit.* (tree credit)
    step_reward.estimator                            -> credit.name (terminal: the shape's own credit, group or tree)
    step_reward.clean / ode_steps / balanced         -> credit.* (dense, return_to_go, turning_point)
    step_reward.estimator: turning_point             -> also credit.process_rewards: paper (the reading those configs
                                                        ran)
    credit: {name: turning_point, clean, ode_steps, balanced} without semantics or process_rewards (a whole
    turning-point section written before credit.semantics existed: a saved config.yaml, the old preset)
                                                     -> credit.process_rewards: paper
    credit.semantics: released | paper               -> credit.process_rewards: released_code | paper (renamed in 0.2:
                                                        the option says what it switches; the old key goes in the
                                                        release after)
    step_reward.registers / register_pass            -> credit.* (registers); RG-OPD's registers -> loss.rg_opd.registers
    sampling.train_steps_per_rollout: N              -> step_selection: {name: random_subset, count: N}
    loss.clip_range / beta / kl                      -> loss.grpo.*
    loss.step_weighting                              -> step_weighting.name
    loss.rg_opd_weight / rg_opd_reward / rg_opd_reward_kwargs / rg_opd_bands
                                                     -> loss.rg_opd.weight / reward / reward_kwargs / bands
                                                        (weight 0: loss.rg_opd off)

A layer that names its shape (every saved config does) drops the settings of the shapes and estimators it does not
use: the old schema kept them at their defaults, where they did nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

__all__ = ["migrate_layer"]

TREE_CREDIT_KEYS = ("fusion", "width_prune", "width_prune_fraction", "depth_prune_steps", "depth_prune_sliding")
TREE_SHAPE_KEYS = ("split_steps", "branching", "split_noise_scale")
STEP_REWARD_KEYS = {"dense": ("clean", "ode_steps"), "return_to_go": ("clean", "ode_steps"),
                    "turning_point": ("clean", "ode_steps", "balanced"), "registers": ("registers", "register_pass")}
OLD_TURNING_POINT_KEYS = ("clean", "ode_steps", "balanced")
# credit.semantics (TP-GRPO, before 0.2) -> credit.process_rewards: old value -> new value
OLD_SEMANTICS = {"released": "released_code", "paper": "paper"}
OLD_LOSS_KEYS = ("clip_range", "beta", "kl", "step_weighting", "rg_opd_weight", "rg_opd_reward",
                 "rg_opd_reward_kwargs", "rg_opd_bands")


def migrate_layer(layer: Any) -> tuple[Any, list[str]]:
    """``(layer with the old keys moved, [one notice])``; a layer without old keys comes back unchanged."""
    if not isinstance(layer, Mapping):
        return layer, []
    data = copy.deepcopy(dict(layer))
    moved: list[str] = []

    def section(name: str) -> dict:
        value = data.get(name)
        if not isinstance(value, dict):
            value = data[name] = {}
        return value

    rollout = data.get("rollout") if isinstance(data.get("rollout"), Mapping) else None
    shape = None
    if rollout is not None and "shape" in rollout:
        shape = rollout.pop("shape")
        rollout["name"] = shape
        moved.append("rollout.shape -> rollout.name")
        if shape != "tree":
            for key in TREE_SHAPE_KEYS + TREE_CREDIT_KEYS:
                rollout.pop(key, None)
        if shape != "probe":
            rollout.pop("probe_steps", None)
        if shape == "tree":
            section("credit").setdefault("name", "tree")
    if rollout is not None:
        for key in [k for k in TREE_CREDIT_KEYS if k in rollout]:
            section("credit")[key] = rollout.pop(key)
            moved.append(f"rollout.{key} -> credit.{key}")

    step = data.pop("step_reward", None)
    old_registers = None
    if isinstance(step, Mapping):
        step = dict(step)
        old_registers = step.get("registers")
        estimator = step.pop("estimator", None)
        if estimator is not None:
            moved.append("step_reward.estimator -> credit.name")
        if estimator == "terminal":
            if shape is not None:
                section("credit")["name"] = "tree" if shape == "tree" else "group"
            kept: tuple[str, ...] = ()
        elif estimator is not None:
            section("credit")["name"] = estimator
            kept = STEP_REWARD_KEYS.get(estimator, ())
            if estimator == "turning_point":
                section("credit")["process_rewards"] = "paper"
        else:
            kept = tuple(step)
        for key in kept:
            if key in step and not (key == "registers" and step[key] is None):
                section("credit")[key] = step[key]
                moved.append(f"step_reward.{key} -> credit.{key}")

    sampling = data.get("sampling")
    if isinstance(sampling, Mapping) and "train_steps_per_rollout" in sampling:
        count = sampling.pop("train_steps_per_rollout")
        if count is not None:
            data["step_selection"] = {"name": "random_subset", "count": count}
        elif shape is None:
            data["step_selection"] = {"name": "all"}
        moved.append("sampling.train_steps_per_rollout -> step_selection")

    loss = data.get("loss")
    if isinstance(loss, Mapping) and any(k in loss for k in OLD_LOSS_KEYS):
        loss = dict(loss)
        new_loss = {k: v for k, v in loss.items() if k not in OLD_LOSS_KEYS}
        grpo = {k: loss[k] for k in ("clip_range", "beta", "kl") if k in loss}
        if grpo:
            new_loss["grpo"] = {**(new_loss.get("grpo") or {}), **grpo}
            moved.append("loss.clip_range/beta/kl -> loss.grpo.*")
        if "step_weighting" in loss:
            data["step_weighting"] = {"name": loss["step_weighting"]}
            moved.append("loss.step_weighting -> step_weighting.name")
        weight = loss.get("rg_opd_weight")
        opd_keys = {"rg_opd_reward": "reward", "rg_opd_reward_kwargs": "reward_kwargs", "rg_opd_bands": "bands"}
        if weight is not None and weight == 0:
            new_loss["rg_opd"] = None
        elif weight is not None or any(k in loss for k in opd_keys):
            opd: dict[str, Any] = {} if weight is None else {"weight": weight}
            for old, new in opd_keys.items():
                if old in loss and loss[old] not in (None, {}):
                    opd[new] = loss[old]
            if opd.get("reward") is None and old_registers is not None and weight is not None:
                opd["registers"] = old_registers
            new_loss["rg_opd"] = opd
        if weight is not None or any(k in loss for k in opd_keys):
            moved.append("loss.rg_opd_* -> loss.rg_opd.*")
        data["loss"] = new_loss

    credit = data.get("credit")
    renamed = []
    if isinstance(credit, Mapping) and "semantics" in credit:
        credit = data["credit"] = dict(credit)
        old = credit.pop("semantics")
        new = OLD_SEMANTICS.get(old, old) if isinstance(old, str) else old
        credit.setdefault("process_rewards", new)
        renamed = [f"credit.semantics was renamed credit.process_rewards (credit.semantics = {old} -> "
                   f"credit.process_rewards = {new}); the old key goes in the next release: write the new one "
                   "(flowalign.training.migration)"]
    if (isinstance(credit, Mapping) and credit.get("name") == "turning_point" and "process_rewards" not in credit
            and all(key in credit for key in OLD_TURNING_POINT_KEYS)):
        data["credit"] = {**credit, "process_rewards": "paper"}
        return data, ["a turning_point credit section written before credit.semantics existed runs the paper's "
                      "reading: credit.process_rewards = paper added (tp_grpo now follows the released code; "
                      "flowalign.training.migration)"] + _notice(moved)
    if not moved and not renamed:
        return layer, []
    return data, renamed + _notice(moved)


def _notice(moved: list[str]) -> list[str]:
    if not moved:
        return []
    return [f"config keys from before the component redesign moved: {'; '.join(moved)} (resolved configs are "
            "now written the new way: flowalign.training.migration)"]
