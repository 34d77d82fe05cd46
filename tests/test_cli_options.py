"""Every configurable command is built from its settings dataclass by the config loader: generated ``--help``,
``--key value`` / ``--key=value`` / ``key=value`` as the same override, YAML files with ``base:``, did-you-mean for
options, range errors with exit status 2 before anything loads, and no option declared twice."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from flowalign import cli
from flowalign.cli import build_parser, parse_command
from flowalign.cli.options import _MISSING, command_flags

REPO = Path(__file__).resolve().parents[1]


def _schemas():
    from flowalign.evaluation.geneval_eval import GenEvalRunConfig
    from flowalign.evaluation.hpd_eval import HPDRunConfig
    from flowalign.evaluation.ocr_eval import OcrRunConfig
    from flowalign.evaluation.toy_eval import EvalConfig
    from flowalign.inference.sample import SampleConfig
    from flowalign.toy.pretrain import PretrainConfig
    from flowalign.toy.segmenter import SegmenterRun
    from flowalign.prep.train_registers import RegisterTrainConfig

    return {("sample",): SampleConfig, ("eval", "toy"): EvalConfig, ("eval", "geneval"): GenEvalRunConfig,
            ("eval", "hpd"): HPDRunConfig, ("eval", "ocr"): OcrRunConfig, ("prep", "registers"): RegisterTrainConfig,
            ("toy", "pretrain"): PretrainConfig, ("toy", "segmenter"): SegmenterRun}


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("path", list(_schemas()), ids=" ".join)
def test_help_is_generated_from_the_dataclass(path, capsys):
    cls = _schemas()[path]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*path, "--help"])
    assert exit_info.value.code == 0
    shown = _words(capsys.readouterr().out)
    flags = command_flags(cls)
    by_key = {flag.key: flag for flag in flags.values()}
    for f in dataclasses.fields(cls):
        if "registry" in f.metadata:  # a component section: its name option and its components' settings
            assert by_key[f"{f.name}.name"].option in shown
            continue
        flag = by_key[f.name]
        assert flag.option in shown, f.name
        assert _words(f.metadata["help"])[:40] in shown, f.name  # argparse wraps lines; compare the words
        if isinstance(f.default, (int, float, str)) and not isinstance(f.default, bool) and flag.switch is _MISSING:
            assert f"default: {f.default!r}" in shown


def test_help_config_prints_every_key(capsys):
    from flowalign.config import format_help
    from flowalign.inference.sample import SampleConfig

    assert cli.main(["sample", "--help-config"]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == format_help(SampleConfig).strip()
    assert "sampler.lam" in printed and "sampler.name = 'bon'" in printed


@pytest.mark.parametrize("forms", [
    (["eval", "toy", "--steps", "4", "--out", "x"], ["eval", "toy", "--steps=4", "--out=x"],
     ["eval", "toy", "steps=4", "out_dir=x"]),
    (["sample", "--guidance", "fk", "--lam", "5", "--rgs-bands", "0.5:0.2"],
     ["sample", "--guidance=fk", "--lam=5", "--rgs-bands=0.5:0.2"],
     ["sample", "sampler.name=fk", "sampler.lam=5", "sampler.bands=[[0.5, 0.2]]"],
     ["sample", "--lam", "5", "--sampler.bands", "[[0.5, 0.2]]", "--guidance", "fk"],  # a name given later still first
     ["sample", "sampler.lam=5", "--guidance", "fk", "--sampler.bands=[[0.5, 0.2]]"]),
    (["prep", "registers", "--taps", "0", "2", "--no-baseline", "--binary-reward"],
     ["prep", "registers", "taps=[0, 2]", "baseline_x0=false", "partial_credit=false"]),
])
def test_option_forms_give_the_same_config(forms):
    configs = [parse_command(argv)[1] for argv in forms]
    assert all(config == configs[0] for config in configs[1:]), configs


def test_sample_options_reach_the_samplers_settings():
    _, config = parse_command(["sample", "--guidance", "dts", "--dts-soft", "--max-children", "4", "--budget", "30"])
    assert config.sampler.name == "dts" and config.sampler.soft is True and config.sampler.max_children == 4
    assert config.budget == 30
    _, config = parse_command(["sample", "--guidance", "rgs", "--rgs-reward", "hps", "--rgs-reward-kwargs",
                               '{"device": "cpu"}', "--rgs-gradient", "x0"])
    assert (config.sampler.reward, config.sampler.reward_kwargs, config.sampler.gradient) == ("hps", {"device": "cpu"},
                                                                                             "x0")


def test_a_yaml_file_with_base_drives_sample_and_eval_toy(tmp_path):
    (tmp_path / "base.yaml").write_text("steps: 3\nsampler: {name: fk, lam: 2.0, potential: max}\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nbudget: 9\nsampler:\n  lam: 4.0\n")
    _, config = parse_command(["sample", str(tmp_path / "child.yaml"), "--seed", "7"])
    assert (config.steps, config.budget, config.seed) == (3, 9, 7)
    assert (config.sampler.name, config.sampler.lam, config.sampler.potential) == ("fk", 4.0, "max")
    _, config = parse_command(["sample", str(tmp_path / "child.yaml"), "--guidance", "bon"])  # a new sampler: afresh
    assert config.sampler.name == "bon" and not hasattr(config.sampler, "lam")

    (tmp_path / "eval-base.yaml").write_text("steps: 3\nout_dir: from-base\n")
    (tmp_path / "eval.yaml").write_text("base: eval-base.yaml\nimages_per_prompt: 2\n")
    _, config = parse_command(["eval", "toy", str(tmp_path / "eval.yaml"), "--out", "from-cli"])
    assert (config.steps, config.images_per_prompt, config.out_dir) == (3, 2, "from-cli")


@pytest.mark.parametrize("argv,hint", [
    (["sample", "--max-promts", "2"], "did you mean --max-prompts?"),
    (["eval", "toy", "--imagse-per-prompt", "2"], "did you mean --images-per-prompt?"),
    (["prep", "registers", "--itreations=3"], "did you mean --iterations?"),
    (["toy", "segmenter", "--batch_size", "3"], "did you mean --batch-size?"),
])
def test_an_unknown_option_names_the_closest_one(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.startswith("flowalign: error: unrecognized option") and hint in error


def test_an_unknown_dotted_key_gets_the_loaders_did_you_mean(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["sample", "--guidance", "fk", "--sampler.lamb", "3"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "did you mean 'sampler.lam'?" in error


@pytest.mark.parametrize("argv,message", [
    (["sample", "--budget", "0"], "budget must be an integer >= 1, got 0 [from --budget 0]"),
    (["sample", "--guidance", "dts", "--max-children", "1"], "sampler.max_children must be >= 2, got 1 [from "
                                                             "--max-children 1]"),
    (["sample", "--guidance", "fk", "--lam", "nope"], "sampler.lam: expected a float, got 'nope'"),
    (["sample", "--guidance", "fkk"], "did you mean 'fk'?"),
    (["eval", "toy", "--dtype", "fp31"], "did you mean 'fp32'?"),
    (["toy", "segmenter", "--steps", "0"], "steps must be >= 1, got 0 [from --steps 0]"),
    (["toy", "pretrain", "--ema-decay", "2"], "ema_decay must be in [0, 1], got 2 [from --ema-decay 2]"),
    (["prep", "registers", "--samples-per-prompt", "1"], "samples_per_prompt must be >= 2"),
    (["eval", "hpd", "--model", "m"], "missing required setting prompts (--prompts VALUE)"),
])
def test_a_bad_value_fails_with_exit_2_before_any_model_loads(argv, message, tmp_path, capsys, monkeypatch):
    import flowalign.lora_loading

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(flowalign.lora_loading, "load_model", no_loading)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.startswith("flowalign: error:") and message in error, error
    assert list(tmp_path.iterdir()) == []  # nothing written


def _leaf_parsers(parser, path=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _leaf_parsers(sub, (*path, name))
    if path:
        yield path, parser


def test_no_option_is_declared_twice():
    """A configurable command's options are exactly its dataclass's (and its components') plus the generic ones, and
    the command-line package declares no option by hand but ``export``'s (which has no dataclass)."""
    seen = set()
    for path, parser in _leaf_parsers(build_parser()):
        command = parser.get_default("command_spec")
        if command is None:
            continue
        seen.add(path)
        options = [o for a in parser._actions for o in a.option_strings]
        assert len(options) == len(set(options)), path
        expected = {"-h", "--help", "--help-config", "--print-config", *command.all_flags()}
        assert set(options) == expected, (path, set(options) ^ expected)
        schema = command.option_schema() or command.schema()
        for flag in command.all_flags().values():  # each option sets a key of the schema
            head = flag.key.split(".")[0]
            assert head in {f.name for f in dataclasses.fields(schema)} or flag.option in command.aliases, flag
    assert {("sample",), ("eval", "toy"), ("eval", "geneval"), ("eval", "hpd"), ("eval", "ocr"), ("prep", "registers"),
            ("prep", "calibrate"), ("prep", "fit-manifold"), ("prep", "train-discriminator"), ("toy", "pretrain"),
            ("toy", "segmenter"), ("train",), ("calibrate",), ("registers", "train")} <= seen
    for source in (REPO / "flowalign" / "cli").glob("*.py"):
        declared = re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", source.read_text())
        allowed = {"tools.py": {"--out", "--weights", "--merge", "--model", "--dtype", "--device", "--push-to-hub",
                                "--private", "--license"},
                   "options.py": {"--help-config", "--print-config"},
                   "reference.py": {"--check"}}.get(source.name, set())  # python -m flowalign.cli.reference
        assert set(declared) <= allowed, (source.name, declared)


def documented_pages():
    """The docs pages whose command lines must run today: not the generated CLI reference (the help itself) and not
    the dated results pages (the commands as they ran at the commit they name)."""
    return [p for p in sorted((REPO / "docs").rglob("*.md")) if p.parent.name not in ("reference", "results")]


def code_of(page) -> str:
    """The fenced code blocks and inline code spans of a page (a Makefile is all code), one per line, with shell line
    continuations joined."""
    text = page.read_text()
    if page.suffix != ".md":
        return text.replace("\\\n", " ")
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    spans = re.findall(r"`([^`]+)`", prose.replace("\n> ", " ").replace("\n", " "))
    return "\n".join(blocks + spans).replace("\\\n", " ")


def test_every_documented_command_line_still_parses():
    """The command lines of README.md, the Makefile and the docs pages (those needing no file made by an earlier
    step)."""
    pages = [REPO / "README.md", REPO / "Makefile", *documented_pages()]
    text = "\n".join(code_of(page) for page in pages)
    lines = set()
    for match in re.finditer(r"flowalign ((?:sample|eval toy|eval hpd|eval ocr|eval geneval|prep registers|"
                             r"toy pretrain|toy segmenter)\b[^`|#)\n]*)", text):
        line = match.group(1).strip()
        if " " not in line.replace("eval ", "eval_").replace("prep ", "p_").replace("toy ", "t_"):
            continue  # the command's name alone (a table naming `flowalign eval geneval`), not a command line
        if "[" not in line and "$" not in line and ".yaml " not in line:  # a config file: made by the reader
            lines.add(line)
    assert len(lines) >= 15
    for line in sorted(lines):
        parse_command(shlex.split(line))  # raises on any mistake


def test_train_keeps_its_positional_config_overrides_and_resume(tmp_path):
    _, config = parse_command(["train", str(REPO / "configs/methods/flow_grpo_fast.yaml"), "optim.lr=2e-3",
                               "--resume", "latest", "--data.group_size", "16"])
    assert config.optim.lr == 2e-3 and config.train.resume == "latest" and config.data.group_size == 16
    args, _ = parse_command(["prep", "calibrate", "--rounds", "3", "--out", str(tmp_path / "c.yaml"), "--eps2=0.02"])
    assert (args.options.rounds, args.options.eps2, args.options.out) == (3, 0.02, str(tmp_path / "c.yaml"))


def test_train_without_a_config_is_the_default_run_and_a_config_replaces_it(monkeypatch, tmp_path):
    """``flowalign train [KEY=VALUE ...]`` builds on ``configs/default.yaml`` (DiffusionNFT at 3 noise levels a
    sample for 227 iterations at learning rate 1e-3 with the matched EMA 0.99 ** (330 / 227)); a named config builds
    on TrainConfig's own defaults (Flow-GRPO-Fast's)."""
    from flowalign.config import ConfigError, diff_configs, load_config, to_dict
    from flowalign.training.config import TrainConfig

    monkeypatch.chdir(REPO)
    _, default = parse_command(["train"])
    nft = load_config(TrainConfig, REPO / "configs/methods/diffusion_nft.yaml",
                      ["train.iterations=227", "optim.ema_decay=0.985496",
                       "objectives.diffusion_nft.timestep_fraction=0.3", "optim.lr=1e-3"])
    assert diff_configs(to_dict(default), to_dict(nft)) == []
    assert abs(default.optim.ema_decay - 0.99 ** (330 / 227)) < 1e-6 and list(default.objectives) == ["diffusion_nft"]
    _, seeded = parse_command(["train", "train.seed=3"])
    assert diff_configs(to_dict(default), to_dict(seeded)) == ["train.seed: 0 != 3"]
    _, fast = parse_command(["train", str(REPO / "configs/methods/flow_grpo_fast.yaml")])
    assert diff_configs(to_dict(fast), to_dict(TrainConfig())) == [] and fast.train.iterations == 330
    monkeypatch.chdir(tmp_path)  # no configs/default.yaml here: said before anything loads
    with pytest.raises(ConfigError, match=r"configs/default.yaml.*run from the repository root"):
        parse_command(["train", "train.seed=3"])


def test_every_documented_train_command_line_loads_its_config(monkeypatch):
    """``flowalign train ...`` lines of README.md and the docs (presets, model presets, overrides) pass every config
    check, as the command runs them before any model loads; lines naming a file the reader writes are left out."""
    monkeypatch.chdir(REPO)
    pages = [REPO / "README.md", *documented_pages()]
    text = "\n".join(code_of(page) for page in pages)
    lines = set()
    for match in re.finditer(r"^\s*(?:[A-Z_]+=\S+ )*flowalign train( [^`|#)\n]*)?$", text, flags=re.M):
        line = (match.group(1) or "").strip()
        words = shlex.split(line) if line else []
        if any(w.endswith(".yaml") and not (REPO / w).is_file() for w in words) or "--help-config" in words:
            continue  # a config the reader writes (calibrated.yaml, sd35_pickscore.yaml)
        if "--resume" in words or any(w.startswith("train.resume=") for w in words):
            continue  # needs a run to resume
        lines.add(line)
    assert len(lines) >= 10, sorted(lines)
    for line in sorted(lines):
        parse_command(["train", *shlex.split(line)])  # raises on any mistake
