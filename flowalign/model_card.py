"""The model card every ``flowalign export`` writes (``README.md`` in the export folder, the Hugging Face Hub's
model card): YAML front matter (license fields, base model, library, tags) and a body that says what the weights are:
the base model, the training method and its paper, the rewards, the measured before/after (the run's
``eval/before_after.md`` when it describes the exported weights), a diffusers loading snippet, and the training
config (the checkpoint's ``config.yaml``).

The method is read from the checkpoint's resolved config (``training_method``): its objective when it has one, else a
credit estimator or rollout shape of a named method, else the GRPO loss (Flow-GRPO). The license is the base model's
(its ``README.md`` front matter), or ``other`` with a line that asks for it to be set, unless one is given.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

__all__ = ["Method", "METHODS", "base_model_license", "model_card", "training_method"]


@dataclass(frozen=True)
class Method:
    """A training method as a model card names it: its name, the paper (arXiv id) and the reference code (a GitHub
    ``owner/name``), each None when there is none."""

    name: str
    arxiv: str | None = None
    code: str | None = None

    def citation(self) -> str:
        """``Name`` with links to its paper and code (Markdown)."""
        parts = [f"paper: [arXiv:{self.arxiv}](https://arxiv.org/abs/{self.arxiv})"] if self.arxiv else []
        if self.code:
            parts.append(f"reference code: [{self.code}](https://github.com/{self.code})")
        return self.name + (f" ({'; '.join(parts)})" if parts else "")


FLOW_GRPO = Method("Flow-GRPO", "2505.05470", "yifan123/flow_grpo")
# The component that names a method, by config section and registered name (the papers of docs/methods/).
METHODS: dict[tuple[str, str], Method] = {
    ("objectives", "diffusion_nft"): Method("DiffusionNFT", "2509.16117", "NVlabs/DiffusionNFT"),
    ("objectives", "awm"): Method("AWM (Advantage Weighted Matching)", "2509.25050", "scxue/advantage_weighted_matching"),
    ("objectives", "dpo"): Method("Online Diffusion-DPO", "2311.12908"),
    ("objectives", "adjoint_matching"): Method("DRL (adjoint matching)", "2606.19162"),
    ("objectives", "soar"): Method("SOAR", "2604.12617", "Tencent-Hunyuan/HY-SOAR"),
    ("objectives", "shell_lcc"): Method("Shell-LCC", "2606.30248"),
    ("objectives", "flow_matching"): Method("supervised fine-tuning (flow matching)"),
    ("credit", "tree"): Method("BranchGRPO", "2509.06040"),
    ("credit", "dense"): Method("DenseGRPO", "2601.20218"),
    ("credit", "euphonium"): Method("Euphonium", "2602.04928"),
    ("credit", "diversity"): Method("GARDO", "2512.24138"),
    ("credit", "turning_point"): Method("TP-GRPO", "2602.06422"),
    ("credit", "vgpo"): Method("VGPO", "2512.12387"),
    ("credit", "registers"): Method("Register-GRPO"),
    ("rollout", "probe"): Method("TempFlow-GRPO", "2508.04324"),
}


def training_method(config: dict) -> Method:
    """The method a resolved training config (a checkpoint's ``config.yaml``) trains with (module docstring)."""
    for name in (config.get("objectives") or {}):
        if ("objectives", name) in METHODS:
            return METHODS[("objectives", name)]
    for section in ("credit", "rollout"):
        name = (config.get(section) or {}).get("name")
        if (section, name) in METHODS:
            return METHODS[(section, name)]
    if "grpo" in (config.get("loss") or {}):
        return FLOW_GRPO
    objectives = ", ".join(config.get("objectives") or {}) or "none"
    return Method(f"flowalign (objectives: {objectives})")


def _front_matter(text: str) -> dict:
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, re.DOTALL)
    if not match:
        return {}
    try:
        found = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return {}
    return found if isinstance(found, dict) else {}


def base_model_license(base_model: str) -> dict[str, str]:
    """The license fields (``license``, ``license_name``, ``license_link``) of a local base model's ``README.md``
    front matter; empty when there is none (a hub id, or no card)."""
    card = Path(base_model) / "README.md"
    if not card.is_file():
        return {}
    found = _front_matter(card.read_text(encoding="utf-8", errors="replace"))
    return {key: str(found[key]) for key in ("license", "license_name", "license_link") if found.get(key)}


def _is_hub_id(name: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", name)) and not Path(name).exists()


def _first_prompt(config: dict) -> str:
    path = (config.get("data") or {}).get("train_prompts")
    try:
        line = Path(path).read_text(encoding="utf-8").splitlines()[0] if path else ""
        return str(json.loads(line)["prompt"]) if line.startswith("{") else line.strip()
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return ""


def _rewards_table(config: dict) -> str:
    rewards = (config.get("reward") or {}).get("rewards") or []
    if not rewards:
        return "The rewards were given to the trainer in Python; the config does not name them."
    rows = ["| reward | weight | arguments |", "|---|---|---|"]
    for spec in rewards:
        spec = spec if isinstance(spec, dict) else {"name": spec}
        kwargs = spec.get("kwargs") or {}
        rows.append(f"| `{spec.get('name')}` | {spec.get('weight', 1.0)} | "
                    f"{json.dumps(kwargs) if kwargs else '-'} |")
    combine = (config.get("reward") or {}).get("combine")
    return "\n".join(rows) + (f"\n\nCombined by `{combine}`." if combine and len(rewards) > 1 else "")


def model_card(*, config: dict, base_model: str, weights: str | None, merged: bool, load_from: str,
               before_after: str | None, license_fields: dict[str, str] | None = None,
               checkpoint: str = "") -> str:
    """The card's text (module docstring). ``load_from``: where the snippet loads the export from (a hub repo id or
    the export folder); ``before_after``: the run's ``eval/before_after.md`` when it describes these weights, else
    None; ``license_fields``: the front matter's license fields (default: ``license: other``)."""
    method = training_method(config)
    license_fields = dict(license_fields or {"license": "other"})
    front = {**license_fields, "library_name": "diffusers",
             "tags": ["flowalign", "text-to-image", "reinforcement-learning", "lora" if not merged else "merged-lora"]}
    if _is_hub_id(base_model):
        front["base_model"] = base_model
    model = config.get("model") or {}
    rank, alpha = model.get("lora_rank"), model.get("lora_alpha")
    prompt = _first_prompt(config) or "a photo of a cat"
    if merged:
        snippet = (f'pipe = DiffusionPipeline.from_pretrained("{load_from}")\n')
    else:
        snippet = (f'pipe = DiffusionPipeline.from_pretrained("{base_model}")\n'
                   f'pipe.load_lora_weights("{load_from}")\n')
    lines = [
        "---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
        f"# {method.name} fine-tune of {base_model}", "",
        f"{'A whole pipeline with the LoRA merged into its transformer' if merged else 'A LoRA'} "
        f"(rank {rank}, alpha {alpha}) trained with flowalign from "
        f"`{checkpoint}` ({weights or 'last'} weights).", "",
        "## Base model", "", f"`{base_model}`" + ("" if "base_model" in front else " (a local directory)"), "",
        "## Method", "", method.citation(), "",
        "## Rewards", "", _rewards_table(config), "",
        "## Measured before and after", "",
        (before_after.strip() + "\n\nThe training run's held-out evaluation (`eval/before_after.md`): the base model "
         "(before) and these weights (after) on the same captions and seeds.") if before_after else
        "Not measured for these weights: the run evaluated none (`train.eval_at_end=false`, or a stopped run), or "
        "its evaluation read other weights (another checkpoint, or the EMA where these are the last weights).", "",
        "## Use with diffusers", "", "```python", "from diffusers import DiffusionPipeline", "", snippet.rstrip(),
        f'image = pipe({json.dumps(prompt)}).images[0]', "```", "",
        "## License", "",
        ("The weights are derived from the base model and are bound by its license: "
         f"`{license_fields.get('license')}`" + (f" ({license_fields['license_name']})"
                                                 if "license_name" in license_fields else "") + ".")
        if license_fields.get("license") != "other" or "license_name" in license_fields else
        "The weights are derived from the base model and are bound by its license, which flowalign did not find "
        "in the base model's card: set the `license` fields above to it before publishing.", "",
        "## Training config", "", "```yaml", yaml.safe_dump(config, sort_keys=False).rstrip(), "```", "",
    ]
    return "\n".join(lines)
