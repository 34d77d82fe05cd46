"""Flow-GRPO's OCR reward: the released rule on hand-computed cases (``ocr_reward_from_lines``), the edit distance, the
prompt and extra checks, and the real PP-OCRv4 engine (the ocr extra) on rendered text, a blank image and the toy
model's samples (``flowalign eval ocr``).

Each rule case states its normalised strings and distance: ``t`` the target, ``x`` the joined text, ``d`` the
Levenshtein distance; the reward is ``1 - min(d, |t|)/|t|``."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from flowalign.reward_models.ocr_rule import check_ocr_prompt, edit_distance, ocr_reward_from_lines, ocr_target

REPO = Path(__file__).resolve().parents[1]
TOY_MODEL = REPO / "assets" / "toy-sd3"
SIGN = 'a shop sign that says "Hello World" in neon'  # t = "helloworld", |t| = 10


# ------------------------------------------------------------------------------------------------ edit distance


@pytest.mark.parametrize("a, b, distance", [
    ("", "", 0), ("", "abc", 3), ("abc", "", 3), ("abc", "abc", 0),
    ("kitten", "sitting", 3),  # k->s, e->i, +g
    ("flaw", "lawn", 2),  # -f, +n
    ("cdab", "abcd", 4),  # no alignment beats 4: two deletions and two insertions, or four substitutions
    ("closed", "open", 4),  # two deletions, and of o-p-e-n only o and e can match in order: two substitutions
    ("i\u0307stanbul", "istanbul", 1),  # the combining dot is a code point of its own
])
def test_edit_distance_by_hand(a, b, distance):
    assert edit_distance(a, b) == distance and edit_distance(b, a) == distance


def test_edit_distance_agrees_with_the_recursive_definition():
    """The one-row programme against the definition itself (memoised recursion) on random short strings."""
    import functools
    import random

    def definition(a: str, b: str) -> int:
        @functools.lru_cache(maxsize=None)
        def d(i: int, j: int) -> int:
            if i == 0 or j == 0:
                return i + j
            return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

        return d(len(a), len(b))

    rng = random.Random(0)
    for _ in range(200):
        a, b = ("".join(rng.choice("ab\u0130 ") for _ in range(rng.randrange(7))) for _ in range(2))
        assert edit_distance(a, b) == definition(a, b), (a, b)


# ------------------------------------------------------------------------------------------------ the rule


CASES = {
    # name: (prompt, lines, reward)
    "exact": (SIGN, [("Hello World", 0.99)], 1.0),
    "case and spaces": (SIGN, [("HELLO  world", 0.9)], 1.0),  # x = "helloworld"
    "substring: extra text is free": (SIGN, [("Big Hello World Sale", 0.9)], 1.0),
    "typo, one substitution": (SIGN, [("Hallo World", 0.9)], 1 - 1 / 10),
    "typos, two deletions": (SIGN, [("Helo Wrld", 0.9)], 1 - 2 / 10),  # x = "helowrld"
    "missing word": (SIGN, [("Hello", 0.9)], 1 - 5 / 10),  # five insertions
    "lines joined in the engine's order": ('a sign "ab cd"', [("cd", 0.9), ("ab", 0.9)], 0.0),  # d("cdab", "abcd") = 4
    "lines in order": ('a sign "ab cd"', [("ab", 0.9), ("cd", 0.9)], 1.0),
    "nothing detected": (SIGN, [], 0.0),  # d = |t|
    "garbage longer than the target is clamped": ('a sign "abc"', [("xyzxyzxyzxyzxyz", 0.9)], 0.0),  # d = 15 -> 3
    "confidence 0 is dropped": (SIGN, [("Hello", 0.0), ("World", 0.9)], 1 - 5 / 10),  # x = "world"
    "negative confidence is dropped": (SIGN, [("Hello", -0.3), ("World", 0.9)], 1 - 5 / 10),
    "engine error": (SIGN, None, 0.0),
    "apostrophe missing": ('a poster reading "Don\'t Stop"', [("Dont Stop", 0.9)], 1 - 1 / 9),  # t = "don'tstop"
    "curly apostrophe": ('a poster reading "Don\'t Stop"', [("Don\u2019t Stop", 0.9)], 1 - 1 / 9),
    "superscript two read as 2": ('a board with "E=mc\u00b2"', [("E=mc2", 0.9)], 1 - 1 / 5),  # t = "e=mc²"
    "one half read as 1/2": ('a sign "\u00bd Price"', [("1/2 Price", 0.9)], 1 - 3 / 6),  # ½->1, +/, +2
    "two quoted spans: the first": ('a sign "Open" and a sign "Closed"', [("Closed", 0.9)], 0.0),  # d = 4 = |t|
    "two quoted spans, both read": ('a sign "Open" and a sign "Closed"', [("Open Closed", 0.9)], 1.0),
    "one quote: the rest of the prompt": ('a sign that says "Open late', [("Open", 0.9)], 1 - 4 / 8),
    "tab stays": ('a label "A\tB"', [("A B", 0.9)], 1 - 1 / 3),  # t = "a\tb", x = "ab"
    "tab read": ('a label "A\tB"', [("a\tb", 0.9)], 1.0),
    "dotted capital I lower-cases to two code points": ('a sign "\u0130stanbul"', [("Istanbul", 0.9)], 1 - 1 / 9),
    "dotted capital I read": ('a sign "\u0130stanbul"', [("\u0130STANBUL", 0.9)], 1.0),
    "spaced letters in the target": ('a sign "H E L L O"', [("HELLO", 0.9)], 1.0),
    "spaced letters read": ('a sign "HELLO"', [("H E L L O", 0.9)], 1.0),
    "digit read as a letter": ('a plate "2024"', [("2O24", 0.9)], 1 - 1 / 4),
    "digits": ('a runway backdrop "Spring Collection 2024"', [("Spring Collection 2025", 0.9)], 1 - 1 / 20),
}


@pytest.mark.parametrize("name", list(CASES))
def test_released_rule_by_hand(name):
    prompt, lines, reward = CASES[name]
    assert ocr_reward_from_lines(prompt, lines) == pytest.approx(reward, abs=1e-12)


@pytest.mark.parametrize("prompt, lines, reward", [
    ("Open", [("OPEN", 0.9)], 1.0),  # no quote: the whole prompt is the target
    ("neon open sign", [("Open", 0.9)], 1 - 8 / 12),  # t = "neonopensign": eight insertions
    (SIGN, [("Hello", 0.0), ("World", 0.9)], 1.0),  # every line counts, whatever its confidence
    ('a sign that says "Open late', [("Open late", 0.1)], 1.0),
])
def test_flow_factory_variant_by_hand(prompt, lines, reward):
    assert ocr_reward_from_lines(prompt, lines, variant="flow_factory") == pytest.approx(reward, abs=1e-12)


@pytest.mark.parametrize("prompt, lines", [
    ("a neon sign saying open", [("open", 0.9)]),  # no quote: the released IndexError
    ("a neon sign saying open", None),
    ('a sign that says ""', [("anything", 0.9)]),  # empty target: the released ZeroDivisionError
    ('a sign that says ""', None),
    ('a sign that says "  "', [("x", 0.9)]),  # only spaces: empty once normalised
])
def test_prompts_the_released_code_crashes_on_are_value_errors_naming_them(prompt, lines):
    with pytest.raises(ValueError, match=re.escape(repr(prompt))):
        ocr_reward_from_lines(prompt, lines)
    with pytest.raises(ValueError):
        check_ocr_prompt(prompt)


def test_an_engine_error_on_a_target_of_spaces_scores_zero_as_released():
    """The released except-branch sets the distance to the target's length before normalisation (here 2)."""
    assert ocr_reward_from_lines('a sign that says "  "', None) == 0.0
    assert ocr_target('say "  "') == "  " and ocr_target("no quote", variant="flow_factory") == "no quote"
    with pytest.raises(ValueError, match="unknown OCR variant"):
        ocr_reward_from_lines(SIGN, [], variant="paddle")


# ------------------------------------------------------------------------------------------------ the reward


def test_the_ocr_reward_is_registered_and_refuses_what_it_cannot_score(ocr):
    from flowalign.errors import RewardInputError
    from flowalign.reward_models.ocr import OcrReward
    from flowalign.rewards import require_prompt_metadata, reward_class, score_range

    assert reward_class("ocr") is OcrReward and score_range("ocr") == (0.0, 1.0)
    prompts = [{"prompt": SIGN}, {"prompt": "a plain sign"}, {"prompt": 'say ""'}]
    with pytest.raises(ValueError, match=r"reward.rewards\[0\].name: the 'ocr' reward cannot score prompt 2 of "
                                         r"p.txt: OCR prompt 'a plain sign' has no double-quoted text"):
        require_prompt_metadata("ocr", "reward.rewards[0].name", prompts, "p.txt")
    require_prompt_metadata("ocr", "k", prompts[:2], "p.txt", {"variant": "flow_factory"})  # its own target
    with pytest.raises(ValueError, match="prompt 3 of p.txt.*empty text"):
        require_prompt_metadata("ocr", "k", prompts, "p.txt", {"variant": "flow_factory"})
    with pytest.raises(RewardInputError, match=r"prompts\[1\]: OCR prompt 'a plain sign'"):
        ocr.check_inputs([SIGN, "a plain sign"], [{}, {}])


def test_pixels_are_the_released_uint8_rgb():
    from flowalign.reward_models.ocr import to_ocr_pixels

    images = torch.zeros(1, 3, 2, 2)
    images[0, 0] = torch.tensor([[1.0, 0.5], [1.2, -0.1]])  # red channel: 255, 127.5 rounds half to even, clamps
    pixels = to_ocr_pixels(images)
    assert pixels.dtype.name == "uint8" and pixels.shape == (1, 2, 2, 3)
    assert pixels[0, :, :, 0].tolist() == [[255, 128], [255, 0]] and pixels[0, :, :, 1:].max() == 0  # RGB kept


def test_the_ocr_extra_missing_is_refused_naming_it(monkeypatch):
    from flowalign.rewards import check_reward_run

    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # Python's way to block an import
    with pytest.raises(ValueError, match=r"the 'ocr' reward \(reward.rewards\[0\]\) needs the rapidocr-onnxruntime "
                                         r"package.*pip install -e '\.\[ocr\]'"):
        check_reward_run("ocr", {}, key="reward.rewards[0].kwargs", model=None)


# ------------------------------------------------------------------------------------------------ the real engine


@pytest.fixture(scope="module")
def ocr():
    from flowalign.reward_models.ocr import OcrReward

    return OcrReward(threads=1)


def test_the_engine_reads_rendered_text_and_a_blank_image_scores_zero(ocr):
    """PP-OCRv4 reads DejaVu Sans at 40 px on 256 px images, and at 8 px on a 32 px one; a blank image has no
    line."""
    from flowalign.evaluation.rendered_text import render_text

    words = ["Hello World", "Open 24 Hours", "Spring Sale"]
    images = torch.stack([render_text(w, size=256, font_px=40) for w in words] + [torch.ones(3, 256, 256)])
    prompts = [f'a sign that says "{w}"' for w in words] + [SIGN]
    scores = ocr(images, prompts, [{}] * 4)
    assert scores.dtype == torch.float64 and scores.shape == (4,)
    assert scores[:3].tolist() == [1.0, 1.0, 1.0], ocr.read(images[:3])
    assert scores[3].item() == 0.0 and ocr.read(images[3:]) == [[]]
    # at the toy world's size too: 8 px letters on a 32 x 32 image (the engine scales it up)
    assert ocr(render_text("Hello World", size=32, font_px=8)[None], [SIGN]).tolist() == [1.0]


def test_eval_ocr_on_the_toy_model_writes_every_image_s_reward(ocr, tmp_path):
    from flowalign.evaluation.ocr_eval import OcrRunConfig, ocr_summary, run_ocr

    prompts = tmp_path / "ocr.txt"
    prompts.write_text('a red sign that says "STOP"\na blue square with "42" on it\n')
    config = OcrRunConfig(model=str(TOY_MODEL), prompts=str(prompts), steps=2, images_per_prompt=1, batch_size=4,
                          out_dir=str(tmp_path / "out"), device="cpu")
    summary = run_ocr(config, scorer=ocr)
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    images = record["images"]
    assert [(r["prompt_index"], r["image_index"], r["target"]) for r in images] == [(0, 0, "STOP"), (1, 0, "42")]
    for r in images:  # each reward is the rule applied to what the engine read
        assert r["reward"] == pytest.approx(ocr_reward_from_lines(f'"{r["target"]}"', [(r["read"], 1.0)]))
    assert summary == ocr_summary([r["reward"] for r in images], 2) == record["summary"]
    assert "OCR reward" in (tmp_path / "out" / "summary.md").read_text()


def test_eval_ocr_refuses_an_unquoted_prompt_before_the_model_loads(tmp_path, capsys):
    from flowalign.cli import main

    prompts = tmp_path / "ocr.txt"
    prompts.write_text('a sign that says "Open"\na sign without quotes\n')
    with pytest.raises(SystemExit) as exit_status:
        main(["eval", "ocr", "--model", str(tmp_path / "no-model"), "--prompts", str(prompts), "--out",
              str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_status.value.code == 2 and "prompt 2 of" in err and "'a sign without quotes'" in err, err
    assert not (tmp_path / "out").exists()


def test_flow_grpo_s_ocr_test_prompts_ship_with_their_license_and_all_quote_a_target():
    from flowalign.data.prompts import load_prompts
    from flowalign.evaluation.ocr_eval import OcrRunConfig

    path = OcrRunConfig(model="m").prompts_path()
    entries = load_prompts(path)
    assert len(entries) == 1018 and all(check_ocr_prompt(e["prompt"]) is None for e in entries)
    assert "MIT License" in (path.parent / "ocr_test.LICENSE").read_text()


def test_a_run_s_held_out_evaluation_leaves_out_the_ocr_reward_on_prompts_without_quotes(ocr):
    """The toy world's end-of-run evaluation scores its toy prompts with the run's rewards: ``ocr`` refuses them
    (``check_inputs``), so it is left out there instead of failing the finished run; the others are scored."""
    from flowalign.rewards import BrightnessReward
    from flowalign.training.evaluation import score_with_rewards

    metadata = [{"prompt": "a photo of a red circle"}, {"prompt": 'a sign that says "Open"'}]
    results = [{"prompt_id": 0, "image_index": 0}, {"prompt_id": 1, "image_index": 0}]
    names = score_with_rewards([("ocr", 1.0, ocr), ("brightness", 1.0, BrightnessReward())], results,
                               torch.ones(2, 3, 8, 8), metadata)
    assert names == ["brightness"] and [r["reward/brightness"] for r in results] == [1.0, 1.0]
    assert all("reward/ocr" not in r for r in results)
