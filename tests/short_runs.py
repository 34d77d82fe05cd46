"""A finished short training run on the tiny SD3 (one iteration, brightness, 32 px, the final evaluation on one image
per held-out prompt at 2 ODE steps): what the tests of a run's end, of eval toy on a checkpoint, of the model card and
of the hub read."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def save_tiny_model(path: Path) -> Path:
    """The tiny random SD3 pipeline, with every toy prompt's words in its vocabulary, saved at ``path``."""
    from flowalign.models.tiny import tiny_sd3_pipeline
    from flowalign.toy.prompts import split_prompts

    train, test = split_prompts()
    words = sorted({w for e in train + test for w in e["prompt"].split()})
    tiny_sd3_pipeline(words, seed=0).save_pretrained(path)
    return path


def short_run(model: Path, out: Path, **extra) -> list[str]:
    """The run's overrides (``extra`` replaces or adds keys)."""
    values = {
        "model.path": str(model), "model.lora_rank": 4, "model.lora_alpha": 8,
        "reward.rewards": "[{name: brightness}]",
        "data.train_prompts": str(REPO / "assets/prompts/train.jsonl"),
        "data.eval_prompts": str(REPO / "assets/prompts/test.jsonl"),
        "data.prompts_per_iteration": 2, "data.group_size": 2, "sampling.num_steps": 4, "sampling.batch_size": 4,
        "sampling.window_size": "null", "sampling.window_start": "fixed", "sampling.window_last": "null",
        "sampling.image_size": 32, "train.iterations": 1, "train.tracker": "none", "train.sample_every": 0,
        "train.out_dir": str(out), "train.eval_images_per_prompt": 1, "train.eval_steps": 2, **extra,
    }
    return [f"{k}={v}" for k, v in values.items()]


def finish_short_run(model: Path, out: Path, **extra):
    """Train the short run into ``out``; its ``TrainResult``."""
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    return Trainer(load_config(TrainConfig, None, short_run(model, out, **extra))).train()
