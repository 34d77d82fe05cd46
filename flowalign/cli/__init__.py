"""The ``flowalign`` command line.

Commands are grouped (``flowalign GROUP COMMAND [options]``). Every configurable command is built from its settings
dataclass by the same loader as ``train`` (``flowalign.cli.options``): ``[CONFIG] [key=value ...]``, where CONFIG is
a YAML file (which may inherit with ``base:``) and the overrides are dotted keys; ``--key VALUE`` and
``--key=VALUE`` are sugar for ``key=VALUE`` (a field's option may have another name, declared with the field);
``--help`` is generated from the dataclass and ``--help-config`` lists every key. Handlers import their modules
lazily, so a command's heavy dependencies load only when it runs.

Bad input (a missing model directory, a number out of range, an unknown option or key, ...) prints
``flowalign: error: ...`` and exits with status 2, without a traceback. Only set-up errors count as bad input
(``flowalign.errors``): a ``SetupError`` (every ``ConfigError`` is one), a ``CommandError``, or an error raised inside
``setup_phase()``. A failure after the work has begun (iteration 200 of a training run) keeps its traceback and exits
with status 1, unless it is a ``RunStopped``: the work stopped on a condition it states (a reward server
that refuses for good, a diverging run), after saving what can be resumed. It prints ``flowalign: stopped: ...``
on one line and exits with status 1, without a traceback. ``flowalign train`` stopped by SIGINT or SIGTERM saves
a checkpoint and exits with 130 or 143 (128 + the signal), so that scripts know the run did not finish.

The library reports progress through ``logging`` (loggers under ``flowalign``) and prints nothing itself but the
results its commands exist for; the command line shows those log records, INFO and above, as plain lines on stdout.

Commands (modules of this package):

* ``flowalign train [CONFIG] [key=value ...] [--resume CKPT]``: GRPO fine-tuning (``train``).
* ``flowalign prep calibrate|fit-manifold|train-discriminator|registers``: the preparation tools (DenseGRPO's noise
  calibration, Shell-LCC's data manifold, DRL's discriminator, latent reward registers), each writing a file that a
  training config names (``prep``). Their names before 0.2 (``flowalign calibrate``, ``flowalign reward
  fit-manifold``, ``flowalign reward train-discriminator``, ``flowalign registers train``) are deprecated aliases.
* ``flowalign sample [CONFIG] --guidance none|bon|fk|dts|rgs|... --budget NFE``: reward-guided sampling with a
  registered guided sampler (``sample``).
* ``flowalign serve-reward [CONFIG] [key=value ...]``: serve registered rewards over HTTP for the ``remote``
  reward (``serve``).
* ``flowalign eval toy|toy-video|geneval|hpd``: GenEval on the toy world, the toy video verifier, GenEval, HPD v2
  (``eval``).
* ``flowalign plan [CONFIG] --gpus N --gpu-memory GiB [--nodes K]``: per-process memory of a training config and
  whether it fits, before any weight loads (``plan``).
* ``flowalign toy pretrain|pretrain-video|segmenter``, ``flowalign export CHECKPOINT --out DIR`` (``tools``). ``sample`` and every
  ``eval`` command take ``--lora DIR [--weights ema|last]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from flowalign.console import command_line_session, show_library_logs

__all__ = ["CommandError", "build_parser", "json_object", "main", "parse_command", "sigma_band"]

PROG = "flowalign"


class CommandError(Exception):
    """Bad input detected by a handler; reported as ``flowalign: error: ...`` with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with errors reported as ``flowalign: error: ...`` (subcommand parsers use this class too)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.print_usage(sys.stderr)
        self.exit(2, f"{PROG}: error: {message}\n")


def sigma_band(text: str) -> tuple[float, float]:
    """argparse type: ``SIGMA:SCALE`` (e.g. ``0.8:0.3``) as a pair of finite numbers (``settings.parse_sigma_band``)."""
    from flowalign.settings import parse_sigma_band

    try:
        return tuple(parse_sigma_band(text))  # type: ignore[return-value]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def json_object(text: str) -> dict:
    """argparse type: a JSON object as a dict (``settings.parse_json_object``)."""
    from flowalign.settings import parse_json_object

    try:
        return parse_json_object(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _group(commands, name: str, help: str):
    """A command group ``flowalign NAME ...`` whose subcommands are required."""
    parser = commands.add_parser(name, help=help, description=help)
    return parser.add_subparsers(dest=f"{name}_command", metavar="COMMAND", required=True)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. The generated options of a configurable command are added only when ``argv`` names
    it (all of them when ``argv`` is None): building them imports the command's settings module (and torch), and
    ``flowalign --help`` needs none of them."""
    from .eval import add_eval_commands
    from .plan import add_plan
    from .options import add_command_flags
    from .prep import add_calibrate, add_fit_manifold, add_prep_commands, add_registers_train, add_train_discriminator
    from .sample import add_sample
    from .serve import add_serve_reward
    from .tools import add_export, add_toy_pretrain, add_toy_pretrain_video, add_toy_segmenter
    from .train import add_train

    parser = _Parser(prog=PROG, description="Align flow-matching text-to-image models with reward models.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_train(commands)
    add_prep_commands(_group(commands, "prep", "prepare what a method needs before training (calibration, a manifold, "
                             "a discriminator, reward registers)"))
    add_calibrate(commands)  # deprecated aliases of the prep commands, for one release
    add_eval_commands(_group(commands, "eval", "evaluate a model"))
    toy = _group(commands, "toy", "toy-world tools")
    add_toy_pretrain(toy)
    add_toy_pretrain_video(toy)
    add_toy_segmenter(toy)
    add_sample(commands)
    add_serve_reward(commands)
    add_export(commands)
    add_plan(commands)
    add_registers_train(_group(commands, "registers", "deprecated: use `flowalign prep registers`"))
    reward = _group(commands, "reward", "deprecated: use `flowalign prep fit-manifold|train-discriminator`")
    add_train_discriminator(reward)
    add_fit_manifold(reward)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the libraries' own output too: diffusers' and transformers' loading bars and "
                        "deprecation warnings")
    add_command_flags(parser, argv)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse, with ``--a.b VALUE`` as the override ``a.b=VALUE`` and ``key=value`` items anywhere on the line; an
    unknown option is an error with the closest known one."""
    from .options import dotted_options, unknown_option

    args, extras = parser.parse_known_args(dotted_options(argv))
    command = getattr(args, "command_spec", None)
    options = [e for e in extras if e.startswith("-")]
    if options or (extras and command is None):
        if command is None:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        name = " ".join(filter(None, (args.command, *(getattr(args, f"{args.command}_command", None),))))
        parser.exit(2, f"{PROG}: error: {unknown_option(options[0], command.all_flags(), name)}\n")
    if extras:
        args.items = [*args.items, *extras]
    return args


def parse_command(argv: Sequence[str]):
    """``(args, config)`` of a configurable command line, every check run and nothing loaded or run (for tests and
    tools: what ``flowalign ARGV`` would run with). Bad input raises ``SystemExit(2)`` or ``ConfigError``."""
    from .options import load_from_args

    args = _parse(build_parser(list(argv)), list(argv))
    return args, load_from_args(args.command_spec, args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns 0 on success, exits with status 2 on bad input, 1 on a ``RunStopped``, and
    quietly with status 1 when its output's reader goes away (``flowalign train --help-config | head``)."""
    try:
        return _main(argv)
    except BrokenPipeError:  # the reader closed the pipe: the standard recipe, no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python flushes stdout at exit; that flush must not fail again
        raise SystemExit(1) from None


def _main(argv: Sequence[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = _parse(parser, argv)
    show_library_logs()
    from flowalign.errors import RunStopped, SetupError

    try:
        with command_line_session(verbose=args.verbose):
            args.handler(args)  # each handler marks its own set-up: a SetupError, or setup_phase()
    except (CommandError, SetupError) as error:
        parser.exit(2, f"{PROG}: error: {error}\n")
    except RunStopped as stopped:  # a clean stop during the work: its message is the whole line
        parser.exit(stopped.exit_status, f"{PROG}: stopped: {' '.join(str(stopped).split())}\n")
    return 0
