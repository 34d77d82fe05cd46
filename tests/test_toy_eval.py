"""Toy evaluation plumbing: CLI outputs, seed pairing, paired differences, grids (random tiny SD3, CPU)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from PIL import Image

from flowalign import cli
from flowalign.evaluation.geneval import load_metadata
from flowalign.evaluation.images import cell_size, save_grid, to_uint8, wrap_caption
from flowalign.evaluation.toy_eval import (
    EvalConfig,
    generate,
    images_per_tag,
    initial_noise,
    paired_difference,
    run_eval,
    sample_seed,
)
from flowalign.models.loading import load_flow_model
from flowalign.models.tiny import tiny_sd3_pipeline
from flowalign.toy.prompts import PROMPT_ASSET_DIR

RESULT_FIELDS = {"prompt_id", "prompt", "tag", "image_index", "seed", "correct", "reason"}


def prompt_words() -> list[str]:
    words = set()
    for path in sorted(PROMPT_ASSET_DIR.glob("*.jsonl")):
        for entry in load_metadata(path):
            words.update(re.findall(r"\w+", entry["prompt"].lower()))
    return sorted(words)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy-eval") / "tiny-sd3"
    tiny_sd3_pipeline(prompt_words(), seed=0).save_pretrained(path)
    return path


def test_cli_eval_toy_writes_outputs(model_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    argv = ["eval", "toy", "--model", str(model_dir), "--max-prompts", "6", "--images-per-prompt", "2",
            "--steps", "2", "--out", str(out), "--device", "cpu"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| overall |" in printed

    record = json.loads((out / "results.json").read_text())
    assert record["config"]["steps"] == 2 and record["config"]["max_prompts"] == 6
    results = record["results"]
    assert len(results) == 12
    metadata = load_metadata(PROMPT_ASSET_DIR / "test.jsonl")[:6]
    for row, result in enumerate(results):
        assert set(result) >= RESULT_FIELDS
        p, k = divmod(row, 2)
        assert (result["prompt_id"], result["image_index"]) == (p, k)
        assert result["prompt"] == metadata[p]["prompt"] and result["tag"] == metadata[p]["tag"]
        assert result["seed"] == sample_seed(0, p, k)
        assert isinstance(result["correct"], bool) and isinstance(result["reason"], str)
        assert result["correct"] == (result["reason"] == "")
    assert record["summary"]["n_images"] == 12 and record["summary"]["n_prompts"] == 6

    summary_md = (out / "summary.md").read_text()
    for tag in {m["tag"] for m in metadata}:
        assert f"| {tag} |" in summary_md
    assert "| overall |" in summary_md
    assert re.search(r"images correct: \d+/12", summary_md) and re.search(r"prompts correct: \d+/6", summary_md)

    with Image.open(out / "grid.png") as grid:
        assert grid.format == "PNG"
        cell_w, cell_h = cell_size(32, 32, 4)
        assert grid.size == (8 * cell_w, 2 * cell_h)  # 12 cells, 8 columns


def test_noise_and_images_do_not_depend_on_batch_size(model_dir):
    model = load_flow_model(model_dir)
    metadata = load_metadata(PROMPT_ASSET_DIR / "test.jsonl")[:2]
    rows = [(p, k) for p in range(2) for k in range(2)]
    full = initial_noise(model, rows, seed=7)
    assert torch.equal(initial_noise(model, rows[3:4], seed=7), full[3:4])
    assert torch.equal(initial_noise(model, rows[::-1], seed=7), full.flip(0))
    assert not torch.equal(full[0], full[1])
    assert not torch.equal(initial_noise(model, rows[:1], seed=8), full[:1])

    kwargs = dict(steps=2, images_per_prompt=2, seed=7)
    one = generate(model, metadata, batch_size=1, **kwargs)
    three = generate(model, metadata, batch_size=3, **kwargs)  # uneven: batches of 3 and 1
    assert one.shape == (4, 3, 32, 32)
    # Same noise per sample; only floating-point reassociation across batch shapes may differ.
    assert torch.allclose(one, three, atol=1e-5)


def test_images_per_tag_balances_tags_and_generate_takes_per_prompt_counts(model_dir):
    metadata = load_metadata(PROMPT_ASSET_DIR / "test.jsonl")
    counts = images_per_tag(metadata, 528)
    per_tag = {}
    for entry, count in zip(metadata, counts):
        per_tag[entry["tag"]] = per_tag.get(entry["tag"], 0) + count
    # 44 color_attr prompts get 12 images each, the 2 two_object prompts 264 each
    assert per_tag == {tag: 528 for tag in per_tag} and len(per_tag) == 6
    tagged = [{"tag": "a"}, {"tag": "a"}, {"tag": "a"}, {"tag": "b"}, {}]
    assert images_per_tag(tagged, 4) == [2, 2, 2, 4, 4]  # rounded up; an untagged entry is its own group
    with pytest.raises(ValueError, match="per_tag"):
        images_per_tag(tagged, 0)

    model = load_flow_model(model_dir)
    two = metadata[:2]
    ragged = generate(model, two, steps=2, images_per_prompt=[1, 3], seed=7)
    full = generate(model, two, steps=2, images_per_prompt=3, seed=7)
    assert ragged.shape[0] == 4
    assert torch.allclose(ragged[0], full[0], atol=1e-5) and torch.allclose(ragged[1:], full[3:], atol=1e-5)
    with pytest.raises(ValueError, match="2 counts for 1 prompts"):
        generate(model, two[:1], steps=2, images_per_prompt=[1, 3])
    with pytest.raises(ValueError, match="images_per_prompt"):
        generate(model, two, steps=2, images_per_prompt=[1, 0])


def test_paired_difference_hand_computed():
    def results(correct_by_key):
        return [
            {"prompt_id": p, "image_index": k, "tag": tag, "prompt": f"p{p}", "correct": c}
            for (p, k, tag), c in correct_by_key.items()
        ]

    # counting: d = [1, 0, 1, 0]; colors: d = [0, -1, 0]
    a = results({(0, 0, "counting"): False, (0, 1, "counting"): True, (1, 0, "counting"): False,
                 (1, 1, "counting"): False, (2, 0, "colors"): True, (2, 1, "colors"): True,
                 (3, 0, "colors"): False})
    b = results({(0, 0, "counting"): True, (0, 1, "counting"): True, (1, 0, "counting"): True,
                 (1, 1, "counting"): False, (2, 0, "colors"): True, (2, 1, "colors"): False,
                 (3, 0, "colors"): False})
    out = paired_difference(a, list(reversed(b)))  # matched on keys, not order

    counting, colors = out["tags"]["counting"], out["tags"]["colors"]
    se_counting = math.sqrt((4 * 0.25 / 3) / 4)  # sample var of [1,0,1,0] = 1/3
    se_colors = math.sqrt((1 / 3) / 3)  # [0,-1,0]: mean -1/3, var (1/9+4/9+1/9)/2 = 1/3
    assert counting["n"] == 4 and counting["diff"] == pytest.approx(0.5)
    assert counting["mean_a"] == pytest.approx(0.25) and counting["mean_b"] == pytest.approx(0.75)
    assert counting["se"] == pytest.approx(se_counting) and counting["z"] == pytest.approx(0.5 / se_counting)
    assert colors["diff"] == pytest.approx(-1 / 3) and colors["se"] == pytest.approx(se_colors)
    overall = out["overall"]
    assert overall["n"] == 7
    assert overall["diff"] == pytest.approx((0.5 - 1 / 3) / 2)
    assert overall["se"] == pytest.approx(math.sqrt(se_counting**2 + se_colors**2) / 2)
    assert overall["z"] == pytest.approx(overall["diff"] / overall["se"])
    assert list(out["tags"]) == ["counting", "colors"]  # GenEval's tag order

    with pytest.raises(ValueError, match=r"prompt_id=3, image_index=0"):
        paired_difference(a, b[:-1])
    with pytest.raises(ValueError, match=r"prompt_id=9, image_index=0"):
        paired_difference(a, b + results({(9, 0, "colors"): True}))


def test_cli_missing_model_exits_2(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "toy", "--model", str(missing), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("flowalign: error:") and str(missing) in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option", ["--steps", "--images-per-prompt", "--batch-size"])
def test_cli_rejects_non_positive_numbers(option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "toy", option, "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "flowalign: error:" in err and option in err


def test_run_eval_validates_config(tmp_path):
    with pytest.raises(ValueError, match="steps"):
        run_eval(EvalConfig(model=str(tmp_path), steps=0))
    with pytest.raises(ValueError, match="images_per_prompt"):
        run_eval(EvalConfig(model=str(tmp_path), images_per_prompt=0))


def test_save_grid_size_and_captions(tmp_path):
    images = torch.rand(10, 3, 8, 6)
    captions = [f"caption {i} with quite a lot of words that will need wrapping | yes" for i in range(10)]
    path = save_grid(images, captions, tmp_path / "grid.png", columns=4, scale=3)
    cell_w, cell_h = cell_size(8, 6, 3)
    with Image.open(path) as grid:
        assert grid.format == "PNG" and grid.size == (4 * cell_w, 3 * cell_h)
        pixels = grid.convert("RGB")
        # First image pixel (0, 0) upscaled 3x with nearest neighbour, after the 2 px frame.
        expected = tuple(int(v) for v in to_uint8(images[:1])[0, 0, 0])
        assert pixels.getpixel((2, 2)) == pixels.getpixel((4, 4)) == expected
    lines = wrap_caption(captions[0], 60)
    assert 1 < len(lines) <= 3 and lines[-1].endswith("...")
    with pytest.raises(ValueError, match="captions"):
        save_grid(images, captions[:3], tmp_path / "bad.png")
