"""GenEval's real pipeline (Mask2Former + CLIP colours) on tiny random models, GenEval folder round trips through
the toy model, and the HPD v2 protocol's arithmetic and inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flowalign.evaluation.geneval import judge, load_metadata
from reward_fixtures import register_tiny_open_clip, tiny_mask2former_dir, tiny_open_clip_checkpoint

REPO = Path(__file__).resolve().parents[1]
OBJECT_NAMES = REPO.parent / "shared" / "data" / "geneval" / "object_names.txt"
TOY_MODEL = REPO / "assets" / "toy-sd3"
TOY_PROMPTS = REPO / "assets" / "prompts" / "test.jsonl"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    register_tiny_open_clip(directory)
    return directory


@pytest.fixture(scope="module")
def color_classifier(tiny_dir):
    from flowalign.reward_models.color import ColorClassifier

    checkpoint = tiny_open_clip_checkpoint(tiny_dir, seed=0)
    return ColorClassifier(str(checkpoint), model_name="flowalign-tiny-clip", quick_gelu=False, device="cpu")


@pytest.fixture(scope="module")
def detector(tiny_dir):
    if not OBJECT_NAMES.is_file():
        pytest.skip(f"GenEval's object_names.txt is not at {OBJECT_NAMES}")
    from flowalign.reward_models.detection import Mask2FormerDetector

    return Mask2FormerDetector(str(tiny_mask2former_dir(tiny_dir)), class_names=str(OBJECT_NAMES), device="cpu")


def _images(batch=2, height=48, width=64, seed=0):
    return torch.rand(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ Mask2Former


def test_mask2former_instances_match_the_processor_output(detector):
    from flowalign.reward_models.detection import mask_box

    names = OBJECT_NAMES.read_text().split("\n")
    images = _images()
    found = detector(images)
    assert len(found) == 2 and all(len(instances) > 0 for instances in found)
    # the same model and processor called directly
    pixels = [(img * 255).round().to(torch.uint8).permute(1, 2, 0).numpy() for img in images]
    inputs = detector.processor(images=pixels, return_tensors="pt")
    with torch.no_grad():
        outputs = detector.model(**inputs)
    direct = detector.processor.post_process_instance_segmentation(outputs, threshold=0.0, target_sizes=[(48, 64)] * 2,
                                                                   return_binary_maps=True)
    for instances, result in zip(found, direct):
        nonempty = [(info, mask) for info, mask in zip(result["segments_info"], result["segmentation"].bool().numpy())
                    if mask.any()]
        assert len(instances) == len(nonempty)
        for instance, (info, mask) in zip(instances, nonempty):
            assert instance["class"] == names[info["label_id"]]
            assert instance["score"] == pytest.approx(info["score"]) and 0 <= instance["score"] <= 1
            assert instance["mask"].shape == (48, 64) and np.array_equal(instance["mask"], mask)
            x1, y1, x2, y2 = instance["box"]
            assert instance["box"] == mask_box(mask) and 0 <= x1 < x2 <= 64 and 0 <= y1 < y2 <= 48


def test_mask_box_and_missing_detector_dir(tmp_path):
    from flowalign.reward_models.detection import Mask2FormerDetector, mask_box
    from flowalign.reward_models.weights import MissingWeightsError

    mask = np.zeros((10, 12), bool)
    mask[2:5, 3:9] = True
    assert mask_box(mask) == (3.0, 2.0, 9.0, 5.0) and mask_box(np.zeros((4, 4), bool)) is None
    with pytest.raises(MissingWeightsError, match="mask2former-swin-small-coco-instance.*detector_model"):
        Mask2FormerDetector(str(tmp_path / "mask2former"))


# ---------------------------------------------------------------------------------------------- colours


def test_masked_crop_grey_background_and_box():
    from flowalign.reward_models.color import BACKGROUND_GREY, masked_crop

    image = _images(1, 20, 30)[0]
    mask = np.zeros((20, 30), bool)
    mask[5:10, 8:20] = True
    mask[7, 8] = False
    crop = masked_crop(image, mask, (7.5, 4.2, 20.0, 10.0))  # floor x1, y1; ceil x2, y2
    assert crop.shape == (3, 6, 13)
    assert torch.equal(crop[:, 1:, 1:], image[:, 5:10, 8:20].where(torch.from_numpy(mask[5:10, 8:20]),
                                                                   torch.tensor(BACKGROUND_GREY)))
    assert torch.all(crop[:, 0, :] == BACKGROUND_GREY) and torch.all(crop[:, 3, 1] == BACKGROUND_GREY)


def test_color_classifier_templates_and_argmax(color_classifier):
    from flowalign.reward_models.clipscore import clip_preprocess
    from flowalign.reward_models.color import COLOR_TEMPLATES, GENEVAL_COLORS, masked_crop

    model, tokenizer = color_classifier.model, color_classifier.tokenizer
    classifier = color_classifier.text_classifier("dog")
    assert classifier.shape == (10, 16) and torch.allclose(classifier.norm(dim=1), torch.ones(10))
    texts = [t.format(c="pink", cls="dog") for t in COLOR_TEMPLATES]
    assert texts == ["a photo of a pink dog", "a photo of a pink-colored dog", "a photo of a pink object"]
    embeddings = torch.nn.functional.normalize(model.encode_text(tokenizer(texts)), dim=-1).mean(0)
    assert torch.allclose(classifier[GENEVAL_COLORS.index("pink")], embeddings / embeddings.norm(), atol=1e-5)

    image = _images(1, 40, 40)[0]
    objects = []
    for top in (0, 10, 20):
        mask = np.zeros((40, 40), bool)
        mask[top : top + 15, top : top + 12] = True
        objects.append({"mask": mask, "box": (top, top, top + 12, top + 15)})
    colours = color_classifier.classify(image, objects, "dog")
    by_hand = []
    for obj in objects:
        crop = clip_preprocess(masked_crop(image, obj["mask"], obj["box"])[None], 32)
        feature = torch.nn.functional.normalize(model.encode_image(crop), dim=-1)
        by_hand.append(GENEVAL_COLORS[int((feature @ classifier.T).argmax())])
    assert colours == by_hand and all(c in GENEVAL_COLORS for c in colours)


# ------------------------------------------------------------------------------------ GenEval as a reward


def test_mask2former_detections_reach_the_rule_engine(detector, color_classifier):
    from flowalign.reward_models.geneval import GenEvalDetections, GenEvalReward

    images = _images(2)
    classes = [max(instances, key=lambda i: i["score"])["class"] for instances in detector(images)]
    metadata = [{"tag": "color_attr", "prompt": f"a photo of a red {c}",
                 "include": [{"class": c, "count": 1, "color": "red"}]} for c in classes]
    detections = GenEvalDetections("mask2former", detector_instance=detector, color_classifier=color_classifier)(
        images, metadata)
    for found, wanted in zip(detections, classes):
        for name, objects in found.items():
            scores = [obj["score"] for obj in objects]
            assert scores == sorted(scores, reverse=True)
            for rank, obj in enumerate(objects):
                assert "mask" not in obj and len(obj["box"]) == 4
                # colour only where the prompt asks for one, and only for objects the rules can read
                assert ("color" in obj) == (name == wanted and obj["score"] > 0.3 and rank < 16)
        assert any("color" in obj for objects in found.values() for obj in objects)
        correct, reason = judge(metadata[0], detections[0], (64, 48))
        assert isinstance(correct, bool)
    reward = GenEvalReward("mask2former", detector_instance=detector, color_classifier=color_classifier)
    binary = reward(images, None, metadata)
    reward.partial_credit = True
    partial = reward(images, None, metadata)
    assert set(binary.tolist()) <= {0.0, 1.0} and torch.all(partial >= binary) and torch.all(partial <= 1)
    with pytest.raises(ValueError, match="GenEval jsonl"):
        reward(images, None, [{"prompt": "x"}, {"prompt": "y"}])


def test_geneval_reward_toy_detector_equals_toy_verifier():
    from flowalign.rewards import build_reward
    from flowalign.toy.reward import ToyGenEvalReward
    from flowalign.toy.scenes import render, scene_for

    metadata = load_metadata(TOY_PROMPTS)[::7][:12]
    rng = np.random.default_rng(0)
    scenes = [render(scene_for(entry, rng)) for entry in metadata]
    images = torch.from_numpy(np.stack(scenes)).permute(0, 3, 1, 2).float() / 255
    images[::2] = images[::2].flip(-1)  # mirrored scenes break some position prompts
    for partial in (False, True):
        ours = build_reward("geneval", detector="toy", partial_credit=partial)(images, None, metadata)
        toy = ToyGenEvalReward(partial_credit=partial)(images, None, metadata)
        assert torch.equal(ours, toy)
    assert build_reward("geneval", detector="toy")(images[1::2], None, metadata[1::2]).min() == 1.0


# -------------------------------------------------------------------------------------- GenEval folders


@pytest.fixture(scope="module")
def toy_model():
    from flowalign.models.loading import load_flow_model

    return load_flow_model(str(TOY_MODEL), device="cpu")


def test_geneval_folder_round_trip_same_numbers(toy_model, tmp_path):
    from flowalign.cli import main
    from flowalign.evaluation.geneval_eval import generate_folder, read_folder, score_folder
    from flowalign.evaluation.toy_eval import evaluate
    from flowalign.reward_models.geneval import GenEvalDetections

    metadata = load_metadata(TOY_PROMPTS)[::9][:8]
    settings = dict(steps=4, images_per_prompt=2, seed=3, batch_size=5)
    results, summary, _ = evaluate(toy_model, metadata, **settings)
    folder = generate_folder(toy_model, metadata, tmp_path / "images", **settings)
    assert (folder / "00000" / "metadata.jsonl").is_file() and (folder / "00007" / "samples" / "00001.png").is_file()
    assert [m for _, m, _ in read_folder(folder)] == metadata
    folder_results, folder_summary = score_folder(folder, GenEvalDetections("toy"))
    assert [r["correct"] for r in folder_results] == [r["correct"] for r in results]
    assert folder_summary == summary

    assert main(["eval", "geneval", "--metadata", str(TOY_PROMPTS), "--images", str(folder), "--detector", "toy",
                 "--out", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    assert record["summary"] == summary
    assert "| overall |" in (tmp_path / "out" / "summary.md").read_text()


def test_geneval_folder_errors(tmp_path):
    from flowalign.evaluation.geneval import GenEvalError
    from flowalign.evaluation.geneval_eval import read_folder

    (tmp_path / "00000" / "samples").mkdir(parents=True)
    (tmp_path / "00000" / "metadata.jsonl").write_text('{"tag": "counting", "prompt": "x", "include": [}\n')
    with pytest.raises(GenEvalError, match=r"00000/metadata.jsonl:1: not valid JSON"):
        read_folder(tmp_path)
    (tmp_path / "00000" / "metadata.jsonl").write_text('{"tag": "counting", "prompt": "x", "include": []}\n')
    with pytest.raises(GenEvalError, match=r"metadata.jsonl:1: field 'include'"):
        read_folder(tmp_path)


# -------------------------------------------------------------------------------------------------- HPD


def test_hpd_chunk_arithmetic():
    from flowalign.evaluation.hpd_eval import chunk_stats, format_hpd_table, hpd_summary

    mean, std = chunk_stats(list(range(20)))  # chunks (0,1), (2,3), ...: means 0.5, 2.5, ..., 18.5
    assert mean == pytest.approx(9.5) and std == pytest.approx(2 * np.sqrt(99 / 12))
    mean, std = chunk_stats([1.0] * 3 + [2.0] * 20)  # 23 scores: chunk sizes 3,2,2,...; first chunk all ones
    assert mean == pytest.approx(1.9) and std == pytest.approx(0.3)
    with pytest.raises(ValueError, match="at least 10"):
        chunk_stats([1.0] * 9)
    summary = hpd_summary({"anime": list(range(20)), "photo": [1.0] * 3 + [2.0] * 20})
    assert summary["average"] == pytest.approx((9.5 + 1.9) / 2)
    table = format_hpd_table(summary)
    assert "| anime | 9.50 | 5.7446 | 20 |" in table and "| Average | 5.70 |" in table


def test_hpd_prompt_files_errors_name_file_and_line(tmp_path):
    from flowalign.evaluation.hpd_eval import HPD_STYLES, load_hpd_prompts

    for style in HPD_STYLES:
        (tmp_path / f"{style}.json").write_text(json.dumps([f"{style} prompt {i}" for i in range(3)], indent=1))
    assert load_hpd_prompts(tmp_path)["photo"] == ["photo prompt 0", "photo prompt 1", "photo prompt 2"]
    (tmp_path / "anime.json").write_text('[\n "a cat",\n "a dog"\n "a fox"\n]\n')
    with pytest.raises(ValueError, match=r"anime.json:4: not valid JSON"):
        load_hpd_prompts(tmp_path)
    (tmp_path / "anime.json").write_text('[\n "a cat",\n {"p": 1},\n "a fox"\n]\n')
    with pytest.raises(ValueError, match=r"anime.json:3: entry 1 is \{'p': 1\}"):
        load_hpd_prompts(tmp_path)
    (tmp_path / "anime.json").write_text(json.dumps(["a cat"]))
    (tmp_path / "paintings.json").unlink()
    with pytest.raises(FileNotFoundError, match="paintings.json"):
        load_hpd_prompts(tmp_path)


def test_run_hpd_on_the_toy_model(tiny_dir, tmp_path):
    from flowalign.evaluation.hpd_eval import HPD_STYLES, HPDRunConfig, chunk_stats, run_hpd
    from flowalign.reward_models.hps import HPSv2

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    words = ["red circle", "blue square", "green triangle", "two red squares", "a white circle above a blue square"]
    for style in HPD_STYLES:
        (prompts / f"{style}.json").write_text(json.dumps([f"a {w}" for w in words * 3]))
    scorer = HPSv2(str(tiny_open_clip_checkpoint(tiny_dir, seed=2)), model_name="flowalign-tiny-clip", device="cpu")
    config = HPDRunConfig(model=str(TOY_MODEL), prompts=str(prompts), max_prompts=10, steps=2, batch_size=10,
                          out_dir=str(tmp_path / "out"), device="cpu")
    summary = run_hpd(config, scorer=scorer)
    record = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(summary["styles"]) == list(HPD_STYLES)
    for style in HPD_STYLES:
        scores = record["scores"][style]
        assert len(scores) == 10 and summary["styles"][style]["n"] == 10
        assert summary["styles"][style]["mean"] == pytest.approx(chunk_stats(scores)[0])
        assert all(-100 <= s <= 100 for s in scores)  # 100 x cos
    assert summary["average"] == pytest.approx(np.mean([summary["styles"][s]["mean"] for s in HPD_STYLES]))


def test_eval_cli_bad_input_exits_2(tmp_path, capsys):
    from flowalign.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "geneval", "--metadata", str(TOY_PROMPTS)])
    assert exit_info.value.code == 2 and "--images DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "geneval", "--metadata", str(TOY_PROMPTS), "--images", str(tmp_path / "none"), "--detector", "toy"])
    assert exit_info.value.code == 2 and "none" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "hpd", "--model", str(TOY_MODEL), "--prompts", str(tmp_path / "hpd"), "--hps-checkpoint",
              str(tmp_path / "HPS_v2.1_compressed.pt")])
    assert exit_info.value.code == 2 and "anime.json" in capsys.readouterr().err
