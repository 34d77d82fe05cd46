"""``flowalign prep calibrate|fit-manifold|train-discriminator|registers``: the preparation tools
(``flowalign.prep``), what one method needs before its training run, each written to a file a config then names.

Each command is built from its settings dataclass by the config loader (``flowalign.cli.options``). The names they had
before 0.2 (``flowalign calibrate``, ``flowalign reward fit-manifold``, ``flowalign reward train-discriminator``,
``flowalign registers train``) stay for one release as aliases: the same command, plus one line on stderr naming the
new one (``DEPRECATED_NAMES``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from flowalign.settings import at_least, finite, option

from .options import ConfigCommand, add_config_command

__all__ = ["DEPRECATED_NAMES", "CalibrateOptions", "add_calibrate", "add_deprecated_alias", "add_fit_manifold",
           "add_prep_commands", "add_registers_train", "add_train_discriminator"]


@dataclass
class CalibrateOptions:
    """``flowalign prep calibrate``'s own settings (the rest of its command line is the training config)."""

    out: str = option(None, "the calibrated config to write (YAML)")
    rounds: int = option(10, "calibration rounds")
    eps1: float = option(2.0, "sign-balance tolerance")
    eps2: float = option(0.01, "noise-level step per round")

    def validate(self) -> None:
        from flowalign.settings import check

        check(self.out is not None, "out", "is required: give --out FILE")
        at_least("rounds", self.rounds, 1)
        finite("eps1", self.eps1, 0)
        finite("eps2", self.eps2, 0)


def _run_calibrate(config, args: argparse.Namespace) -> None:
    from flowalign.prep.calibrate import calibrate, write_calibrated_config

    from .options import config_and_overrides
    from .train import _leave_process_group

    options = args.options
    path, overrides = config_and_overrides(args.items)
    levels, history = calibrate(config, rounds=options.rounds, eps1=options.eps1, eps2=options.eps2)
    from flowalign.training.collectives import process_state

    state = process_state()
    if not state.is_main_process:  # every process holds the same levels; the main one writes them
        _leave_process_group(state)
        return
    out = write_calibrated_config(options.out, levels, history, base=path, overrides=overrides, eps1=options.eps1,
                                  eps2=options.eps2)
    print(f"wrote {out}: sampling.noise_table = {levels}")
    _leave_process_group(state)


def _run_fit_manifold(config, args: argparse.Namespace) -> None:
    from flowalign.prep.fit_manifold import fit_model_manifold

    meta = fit_model_manifold(config)
    print(f"wrote {config.out} ({meta['num_bases']} bases on {meta['latent_channels']}-channel latents of "
          f"{meta['fit']['images']} images; data distance {meta['data_distance']:.4f})")


def _run_train_discriminator(config, args: argparse.Namespace) -> None:
    from flowalign.prep.train_discriminator import train_discriminator

    result = train_discriminator(config)
    print(f"wrote {result['checkpoint']} (validation accuracy {result['val_accuracy']:.3f} at step "
          f"{result['selected_step']})")


def _run_registers_train(config, args: argparse.Namespace) -> None:
    from flowalign.prep.train_registers import train_registers

    result = train_registers(config)
    print(f"wrote {result['checkpoint']}")


@dataclass(frozen=True)
class _Prep:
    command: ConfigCommand
    help: str
    description: str


# The commands of ``flowalign prep``, by name, in the order ``--help`` lists them.
PREP = {
    "calibrate": _Prep(
        ConfigCommand("flowalign.training.config:TrainConfig", _run_calibrate, options=CalibrateOptions),
        help="calibrate per-step noise levels (DenseGRPO) and write them as a train config",
        description="Sample trajectories with the training config, score the ODE completion of every state, and "
        "move each stochastic step's noise level up (signs of dR balanced) or down (unbalanced); the result is a "
        "YAML config with sampling.noise_table for `flowalign train`."),
    "fit-manifold": _Prep(
        ConfigCommand("flowalign.prep.fit_manifold:FitManifoldConfig", _run_fit_manifold),
        help="fit a Shell-LCC data manifold on the model's VAE latents of data images (the shell_lcc reward)",
        description="Encode the data images with the model's VAE (posterior mean, the transformer's shift and scale), "
        "fit the two-stage Shell-LCC manifold (LCC skeleton, then the shell head with the skeleton frozen) and write "
        "a safetensors checkpoint with a JSON sidecar naming the model and VAE it was fitted for."),
    "train-discriminator": _Prep(
        ConfigCommand("flowalign.prep.train_discriminator:DiscriminatorTrainConfig", _run_train_discriminator),
        help="train DRL's discriminator reward: data images against the base model's samples, on frozen features",
        description="Sample the base model on the data's prompts, and fit a projection logit r(x, c) = phi(h(f)) + "
        "<h(f), e(c)> + b(c) on frozen features f (the toy segmenter's trunk, or DINOv2's CLS token) with the "
        "logistic loss and an R1 penalty, in buffered refreshes with early stopping on a validation split. Writes "
        "--out (safetensors) and a .json sidecar (feature extractor, image size, base model fingerprint, validation "
        "accuracy); the reward `discriminator` reads it (kwargs: {path: ...})."),
    "registers": _Prep(
        ConfigCommand("flowalign.prep.train_registers:RegisterTrainConfig", _run_registers_train),
        help="train latent reward registers on the model's own samples (pairwise Thurstone loss)",
        description="Sample K trajectories per prompt with the frozen model, label the final images with --reward, "
        "and fit register heads on pairs of noisy states of the same prompt; reports held-out pairwise accuracy "
        "by sigma band (report.md / report.json next to --out)."),
}

# Each command's name before 0.2 -> its ``flowalign prep`` name; the old names go in the next release.
DEPRECATED_NAMES = {
    "flowalign calibrate": "calibrate",
    "flowalign reward fit-manifold": "fit-manifold",
    "flowalign reward train-discriminator": "train-discriminator",
    "flowalign registers train": "registers",
}


def add_prep_commands(group) -> None:
    """The subcommands of ``flowalign prep``."""
    for name, prep in PREP.items():
        add_config_command(group, name, prep.command, help=prep.help, description=prep.description)


def add_deprecated_alias(group, old: str) -> None:
    """``old`` (a key of ``DEPRECATED_NAMES``) as the subcommand of ``group`` it was: the same command, which first
    prints a line on stderr naming its ``flowalign prep`` name."""
    name = DEPRECATED_NAMES[old]
    prep, new = PREP[name], f"flowalign prep {name}"
    parser = add_config_command(group, old.rsplit(" ", 1)[-1], prep.command,
                                help=f"deprecated: use `{new}` ({prep.help})",
                                description=f"Deprecated name of `{new}`, for one release. " + prep.description)
    handle = parser.get_default("handler")

    def handle_deprecated(args: argparse.Namespace) -> None:
        print(f"flowalign: warning: `{old}` is deprecated: use `{new}` (the old name goes in the next release)",
              file=sys.stderr, flush=True)
        handle(args)

    parser.set_defaults(handler=handle_deprecated)


def add_calibrate(commands) -> None:
    """The deprecated ``flowalign calibrate`` (``flowalign prep calibrate``)."""
    add_deprecated_alias(commands, "flowalign calibrate")


def add_fit_manifold(group) -> None:
    """The deprecated ``flowalign reward fit-manifold`` (``flowalign prep fit-manifold``)."""
    add_deprecated_alias(group, "flowalign reward fit-manifold")


def add_train_discriminator(group) -> None:
    """The deprecated ``flowalign reward train-discriminator`` (``flowalign prep train-discriminator``)."""
    add_deprecated_alias(group, "flowalign reward train-discriminator")


def add_registers_train(group) -> None:
    """The deprecated ``flowalign registers train`` (``flowalign prep registers``)."""
    add_deprecated_alias(group, "flowalign registers train")
