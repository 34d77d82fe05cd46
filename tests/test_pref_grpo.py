"""Pref-GRPO's win rates and GDPO's multi-reward advantages (METHODS-3.md §4, §5): the verdict parsers, the rounded
win rates, Flex's blend, the advantages of every variant by hand and against a float64 reference written here from the
spec's table, the config's refusals, and the pairwise judge against a real OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import base64
import io
import itertools
import json
import math
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.gdpo import gdpo_advantages, pref_grpo_advantages
from flowalign.reward_models.pairwise import (flex_win_rates, flex_winner, pairwise_win_rates, parse_flex_payload,
                                              parse_think_verdict)
from flowalign.training.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "configs/methods/pref_grpo.yaml"


def close(actual, expected, tol=1e-12):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual, expected)
    assert torch.allclose(actual, expected, rtol=tol, atol=tol, equal_nan=True), (actual.tolist(), expected.tolist())


# ------------------------------------------------------------------ a float64 reference of METHODS-3.md §5's table
def _blocks(ids, contiguous):
    if not contiguous:
        return [[b for b, g in enumerate(ids) if g == key] for key in sorted(set(ids))]
    out = []
    for b, g in enumerate(ids):
        if out and ids[out[-1][0]] == g:
            out[-1].append(b)
        else:
            out.append([b])
    return out


def _std(values, unbiased):
    if unbiased:
        return statistics.stdev(values) if len(values) > 1 else math.nan
    return statistics.pstdev(values)


def reference(scores, weights, ids, variant, aggregation="gdpo", scale_rewards=True, global_std=True):
    unbiased, R, B = variant != "flow_factory", len(scores), len(ids)

    def norm(values, std):
        return [(v / (max(std, 1e-6) if not math.isnan(std) else std)) if variant == "flow_factory"
                else v / (std + (1e-4 if variant == "nvlabs" else 1e-8)) for v in values]

    def group_norm(row):
        out = [0.0] * B
        for block in _blocks(ids, variant != "flow_factory"):
            values = [row[b] for b in block]
            mean = statistics.fmean(values)
            for b, v in zip(block, norm([v - mean for v in values], _std(values, unbiased))):
                out[b] = v
        return out

    def batch(c):
        mean = statistics.fmean(c)
        return norm([v - mean for v in c], _std(c, unbiased))

    if variant == "nvlabs" and (aggregation == "sum" or R == 1):
        r = [sum(w * s[b] for w, s in zip(weights, scores) if not math.isnan(s[b])) for b in range(B)]
        out = [0.0] * B
        for block in _blocks(ids, True):
            values = [r[b] for b in block]
            mean = statistics.fmean(values)
            for b in block:
                out[b] = (r[b] - mean) / ((_std(values, True) + 1e-4) if scale_rewards else 1.0)
        return out
    if variant == "flow_factory" and aggregation == "sum":
        r = [sum(w * s[b] for w, s in zip(weights, scores)) for b in range(B)]
        out = [0.0] * B
        for block in _blocks(ids, False):
            values = [r[b] for b in block]
            mean = statistics.fmean(values)
            std = max(_std(r if global_std else values, False), 1e-6)
            for b in block:
                out[b] = (r[b] - mean) / std
        return out
    if variant == "nvlabs":
        scores = [[0.0 if math.isnan(v) else v for v in row] for row in scores]
    rows = [group_norm(row) for row in scores]
    c = [sum(w * row[b] for w, row in zip(weights, rows) if not (variant == "nvlabs" and math.isnan(row[b])))
         for b in range(B)]
    return batch(c) if aggregation == "gdpo" else c


# ------------------------------------------------------------------ GDPO by hand (§5)
def test_groups_of_two_by_hand_for_the_three_variants():
    scores, ids = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 1.0, 0.0]], [0, 0, 1, 1]
    # group 0: reward 1 splits, reward 2 is constant; group 1: the two rewards cancel, so c = [a, -a, 0, 0]
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    close(gdpo_advantages(scores, [1.0, 1.0], ids), [x / (math.sqrt(2 / 3) * a + 1e-4) for x in (a, -a, 0, 0)])
    a = 0.5 / (math.sqrt(0.5) + 1e-8)
    close(gdpo_advantages(scores, [1.0, 1.0], ids, variant="pref_grpo"),
          [x / (math.sqrt(2 / 3) * a + 1e-8) for x in (a, -a, 0, 0)])
    # population stds: each split group is +-1, so c = [1, -1, 0, 0], whose population std is sqrt(1/2)
    close(gdpo_advantages(scores, [1.0, 1.0], ids, variant="flow_factory"), [2 ** 0.5, -2 ** 0.5, 0, 0])


def test_two_binary_rewards_by_hand():
    scores, ids = [[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]], [7, 7, 7, 7]
    close(gdpo_advantages(scores, [1, 1], ids, variant="flow_factory"), [2 ** 0.5, 0, 0, -2 ** 0.5])
    b = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # unbiased std of [1, 1, 0, 0] is sqrt(1/3)
    close(gdpo_advantages(scores, [1, 1], ids), [x / (math.sqrt(8 / 3) * b + 1e-4) for x in (2 * b, 0, 0, -2 * b)])


def test_one_reward_follows_each_variants_rule():
    scores, ids = [[1.0, 0.0, 0.0, 0.0]], [0, 0, 0, 0]  # mean 1/4, unbiased std 1/2, population std sqrt(3)/4
    grpo = [x / (0.5 + 1e-4) for x in (0.75, -0.25, -0.25, -0.25)]
    close(gdpo_advantages(scores, [1.0], ids), grpo)  # nvlabs falls back to GRPO: no batch step
    close(gdpo_advantages(scores, [1.0], ids, aggregation="sum"), grpo)
    close(gdpo_advantages(scores, [1.0], ids, aggregation="sum", scale_rewards=False), [0.75, -0.25, -0.25, -0.25])
    third = 1 / math.sqrt(3)  # standardised values already have population std 1: the batch step leaves them
    close(gdpo_advantages(scores, [1.0], ids, variant="flow_factory"), [math.sqrt(3), -third, -third, -third])
    group = [x / (0.5 + 1e-8) for x in (0.75, -0.25, -0.25, -0.25)]  # then its unbiased std is 1 (to 1e-8)
    close(gdpo_advantages(scores, [1.0], ids, variant="pref_grpo"), [x / (statistics.stdev(group) + 1e-8)
                                                                     for x in group])
    close(gdpo_advantages(scores, [1.0], ids, variant="pref_grpo", aggregation="sum"), group)


def test_constant_rewards_in_a_group_give_zero_there():
    scores, ids = [[0.3, 0.3, 0.3, 0.1, 0.9, 0.5], [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]], [0, 0, 0, 1, 1, 1]
    for variant in ("nvlabs", "flow_factory", "pref_grpo"):
        out = gdpo_advantages(scores, [1.0, 0.5], ids, variant=variant)
        assert torch.all(out[:3].abs() < 1e-12), (variant, out)  # c = 0 there and the batch mean of c is 0


def test_a_scale_gap_moves_the_weighted_sum_and_not_gdpo():
    pick = [21.0, 21.5, 22.0, 20.5, 20.0, 20.25, 21.75, 22.25]  # PickScore-like
    binary = [0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    ids = [0, 0, 0, 0, 1, 1, 1, 1]
    base = gdpo_advantages([pick, binary], [1.0, 1.0], ids, variant="flow_factory")
    scaled = gdpo_advantages([[100 * p + 5 for p in pick], binary], [1.0, 1.0], ids, variant="flow_factory")
    close(scaled, base, 1e-9)  # each reward is standardised first: its scale does not matter
    sums = [gdpo_advantages([[k * p for p in pick], binary], [1.0, 1.0], ids, variant="flow_factory",
                            aggregation="sum") for k in (1, 100)]
    assert (sums[0] - sums[1]).abs().max() > 0.1  # GRPO's sum is dominated by the larger scale


CASES = {
    "three weighted rewards": ([[0.1, 0.5, 0.9, 0.2, 0.4, 0.4], [3.0, 1.0, 2.0, 5.0, 4.0, 6.0],
                                [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]], [0.5, 0.3, 0.2], [0, 0, 0, 1, 1, 1]),
    "negative weight": ([[0.1, 0.5, 0.9, 0.2], [3.0, 1.0, 2.0, 5.0]], [1.0, -0.5], [0, 0, 1, 1]),
    "4 groups of 16": (torch.Generator().manual_seed(0), [0.7, 0.3], [g for g in range(4) for _ in range(16)]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("variant", ["nvlabs", "flow_factory", "pref_grpo"])
@pytest.mark.parametrize("aggregation", ["gdpo", "sum"])
def test_every_variant_matches_the_float64_reference(case, variant, aggregation):
    scores, weights, ids = CASES[case]
    if isinstance(scores, torch.Generator):
        scores = torch.rand(2, 64, generator=scores, dtype=torch.float64).tolist()
        scores[1] = [float(x > 0.5) for x in scores[1]]
    for options in ({}, {"scale_rewards": False, "global_std": False}):
        out = gdpo_advantages(scores, weights, ids, variant=variant, aggregation=aggregation, **options)
        close(out, reference(scores, weights, ids, variant, aggregation, **options), 1e-10)


def test_nan_scores_become_zero_under_nvlabs_and_propagate_under_the_others():
    scores, ids = [[math.nan, 1.0, 0.0, 1.0], [0.2, 0.4, 0.6, 0.8]], [0, 0, 1, 1]
    zeroed = [[0.0, 1.0, 0.0, 1.0], scores[1]]
    close(gdpo_advantages(scores, [1, 1], ids), gdpo_advantages(zeroed, [1, 1], ids))
    # the GRPO rule's nansum leaves the NaN out of the weighted sum (here: of sample 0's sum)
    close(gdpo_advantages(scores, [1, 1], ids, aggregation="sum"), reference(scores, [1, 1], ids, "nvlabs", "sum"))
    assert torch.isnan(gdpo_advantages(scores, [1, 1], ids, variant="flow_factory")).all()
    assert torch.isnan(gdpo_advantages(scores, [1, 1], ids, variant="pref_grpo")).all()


def test_interleaved_ids_group_by_id_under_flow_factory_and_are_refused_by_the_block_variants():
    scores = [[0.1, 0.5, 0.9, 0.2, 0.4, 0.3], [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]]
    ids = [3, 1, 3, 1, 3, 1]
    order = [0, 2, 4, 1, 3, 5]  # the same batch sorted by group
    out = gdpo_advantages(scores, [1, 1], ids, variant="flow_factory")
    sorted_out = gdpo_advantages([[row[i] for i in order] for row in scores], [1, 1], [ids[i] for i in order],
                                 variant="flow_factory")
    close(out[order], sorted_out)
    for variant in ("nvlabs", "pref_grpo"):
        with pytest.raises(ValueError, match="consecutive blocks"):
            gdpo_advantages(scores, [1, 1], ids, variant=variant)
    with pytest.raises(ValueError, match="same size"):
        gdpo_advantages([[1.0, 0.0, 1.0]], [1.0], [0, 0, 1], variant="flow_factory", aggregation="sum")
    with pytest.raises(ValueError, match="unknown gdpo variant"):
        gdpo_advantages(scores, [1, 1], ids, variant="verl")


# ------------------------------------------------------------------ Pref-GRPO: parsers (§4)
@pytest.mark.parametrize("text, modality, verdict", [
    ("<think>the first has the cat</think><answer>Image 1 is better</answer>", "image", 1),
    ("<answer>\n  Image 2 is better.\n</answer>", "image", 2),
    ("<answer>Image 1 is better</answer> then <answer>Image 2 is better</answer>", "image", 1),  # the first tag
    ("<answer>Image 2 is better than Image 1 is better</answer>", "image", 1),  # phrase 1 is looked for first
    ("<answer>Both are equally good</answer>", "image", 0),
    ("<answer>image 1 is better</answer>", "image", 0),  # case-sensitive, as released
    ("Image 1 is better", "image", 0),  # no tag
    ("<answer>Image 1 is better", "image", 0),  # no closing tag
    ("<answer>   </answer>", "image", 0),
    ("<answer>Video 2 is better</answer>", "video", 2),
    ("<answer>Video 2 is better</answer>", "image", 0),
    (None, "image", 0),
])
def test_think_verdicts(text, modality, verdict):
    assert parse_think_verdict(text, modality=modality) == verdict


@pytest.mark.parametrize("text, side", [
    ("Image 1", 1), ("image   2", 2), ("Image1", 1), ("VIDEO 2 wins", 2), ("Image 1 and Image 2", None),
    ("Image 12", None), ("tie", None), ("", None), (None, None),
    ('{"winner": "Image 2", "categories": [{"name": "a", "cat_winner": "Image 1"}]}', 2),
])
def test_flex_winners(text, side):
    assert flex_winner(text) == side


def test_flex_payloads():
    assert parse_flex_payload('{"winner": "Image 1"}') == {"winner": "Image 1"}
    assert parse_flex_payload('Sure.\n{"winner": "Image 2",\n "categories": []}\nDone.') == {
        "winner": "Image 2", "categories": []}
    for text in ("no json here", "{bad", "[1, 2]", "", None, "3"):
        assert parse_flex_payload(text) is None


# ------------------------------------------------------------------ win rates
@pytest.mark.parametrize("G", range(2, 10))
def test_a_consistent_judge_gives_each_image_its_rank_over_g_minus_one(G):
    quality = torch.randperm(G, generator=torch.Generator().manual_seed(G)).tolist()  # a permutation of 0..G-1
    verdicts = [(i, j, 1 if quality[i] > quality[j] else 2) for i, j in itertools.combinations(range(G), 2)]
    close(pairwise_win_rates(G, verdicts), [round(q / (G - 1), 3) for q in quality])


def test_noisy_tied_and_unparseable_judges_by_hand():
    close(pairwise_win_rates(3, [(0, 1, 1), (0, 2, 2), (1, 2, 1)]), [0.5, 0.5, 0.5])  # a cycle
    close(pairwise_win_rates(3, [(0, 1, 1), (0, 2, 1), (1, 2, 0)]), [1.0, 0.25, 0.25])
    close(pairwise_win_rates(4, [(i, j, 0) for i, j in itertools.combinations(range(4), 2)]), [0.5] * 4)
    unparsed = [(i, j, parse_think_verdict("I cannot tell.")) for i, j in itertools.combinations(range(4), 2)]
    close(pairwise_win_rates(4, unparsed), [0.5] * 4)
    close(pairwise_win_rates(3, [(0, 1, None)]), [0.5, 0.5, 0.0])  # no answer: a tie; an image in no pair: 0


def test_rates_are_rounded_half_even_like_pythons_round():
    # G = 9: the lower index wins, but for ties (3, 4), (5, 6) and (7, 8). Wins out of 8: 8, 7, 6, 4.5, 4.5, 2.5,
    # 2.5, 0.5, 0.5; 0.5625, 0.3125 and 0.0625 are exact doubles halfway between two 3-decimal numbers
    ties = {(3, 4), (5, 6), (7, 8)}
    verdicts = [(i, j, 0 if (i, j) in ties else 1) for i, j in itertools.combinations(range(9), 2)]
    assert pairwise_win_rates(9, verdicts).tolist() == [1.0, 0.875, 0.75, 0.562, 0.562, 0.312, 0.312, 0.062, 0.062]
    assert [round(x, 3) for x in (0.5625, 0.3125, 0.0625)] == [0.562, 0.312, 0.062]  # half-even, not half-up


def test_bad_verdicts_and_pairs_are_refused():
    for verdicts in ([(0, 1, 3)], [(0, 1, 1.5)], [(1, 1, 1)], [(0, 4, 1)]):
        with pytest.raises(ValueError):
            pairwise_win_rates(3, verdicts)


def _flex(winner, *categories):
    return json.dumps({"winner": winner, "categories": [{"name": n, "cat_winner": w} for n, w in categories]})


FLEX_RESPONSES = [(0, 1, _flex("Image 1", ("align", "Image 1"), ("quality", "Image 2"))),
                  (0, 2, _flex("Image 2", ("align", "Image 2"), ("quality", "tie"))),
                  (1, 2, "not a judgement")]


@pytest.mark.parametrize("ow, dw, expected", [
    (1.0, 1.0, [(0.5 + 0.397) / 2, (0.25 + 0.412) / 2, (0.75 + 0.794) / 2]),
    (0.3, 0.7, [0.3 * 0.5 + 0.7 * 0.397, 0.3 * 0.25 + 0.7 * 0.412, 0.3 * 0.75 + 0.7 * 0.794]),
    (1.0, 0.0, [0.5, 0.25, 0.75]),
])
def test_flex_rates_by_hand_at_three_weightings(ow, dw, expected):
    # overall: 0 beats 1, 2 beats 0, (1, 2) unparsed: a tie -> 1/2, 0.5/2, 1.5/2
    # align: 0 loses to 2 -> rates 1/2, 0, 1; quality: 1 beats 0, (0, 2) a tie -> 0.5/2, 1, 0.5
    # dim_mean with category weights (1, 0.7): (0.5 + 0.7 * 0.25) / 1.7 = 0.397, 0.7 / 1.7 = 0.412, 1.35 / 1.7 = 0.794
    flex = flex_win_rates(3, FLEX_RESPONSES, overall_weight=ow, dim_weight=dw, category_weights=[1.0, 0.7, 0.7])
    close(flex.overall, [0.5, 0.25, 0.75])
    close(flex.dim_mean, [0.397, 0.412, 0.794])
    assert flex.mask.tolist() == [True, True, True] and flex.dims == {"align": [0.5, 0.0, 1.0],
                                                                       "quality": [0.25, 1.0, 0.5]}
    close(flex.rewards, expected)


def test_flex_keeps_overall_without_a_category_comparison_and_counts_three_categories():
    flex = flex_win_rates(3, [(0, 1, "garbage"), (1, 2, _flex("Image 1", *[(f"c{k}", "Image 1") for k in range(5)]))],
                          overall_weight=1.0, dim_weight=1.0, category_weights=None)
    close(flex.overall, [0.5, 0.75, 0.0])
    assert flex.mask.tolist() == [False, True, True] and list(flex.dims) == ["c0", "c1", "c2"]
    close(flex.rewards, [0.5, (0.75 + 1.0) / 2, (0.0 + 0.0) / 2])


# ------------------------------------------------------------------ Pref-GRPO's advantages
THINK = [1.0, 0.5, 0.0, 0.25, 0.25, 0.5]
CLIP = [0.31, 0.29, 0.26, 0.2, 0.22, 0.27]
IDS = [0, 0, 0, 1, 1, 1]


def _group(values, ids=IDS):
    out = [0.0] * len(values)
    for block in _blocks(ids, True):
        vals = [values[b] for b in block]
        for b in block:
            out[b] = (values[b] - statistics.fmean(vals)) / (statistics.stdev(vals) + 1e-8)
    return out


def _batch(values):
    return [(v - statistics.fmean(values)) / (statistics.stdev(values) + 1e-8) for v in values]


@pytest.mark.parametrize("apply_gdpo", [False, True])
def test_think_plus_clip_is_the_weighted_sum_of_group_advantages_renormalised_with_apply_gdpo(apply_gdpo):
    out = pref_grpo_advantages({"unifiedreward_think": THINK, "clip": CLIP}, {"unifiedreward_think": 0.4, "clip": 0.6},
                               IDS, apply_gdpo=apply_gdpo)
    summed = [0.4 * a + 0.6 * b for a, b in zip(_group(THINK), _group(CLIP))]
    close(out, _batch(summed) if apply_gdpo else summed)
    close(out, gdpo_advantages([THINK, CLIP], [0.4, 0.6], IDS, variant="pref_grpo",
                               aggregation="gdpo" if apply_gdpo else "sum"))


def test_think_plus_clip_by_hand():
    # groups of 2: each split pair normalises to +-1/sqrt(2) (unbiased std), a tied pair to 0
    rewards = {"unifiedreward_think": [1.0, 0.0, 0.5, 0.5], "clip": [0.2, 0.4, 0.3, 0.1]}
    weights = {"unifiedreward_think": 0.4, "clip": 0.6}
    c = [x / math.sqrt(2) for x in (0.4 - 0.6, -0.4 + 0.6, 0.6, -0.6)]
    close(pref_grpo_advantages(rewards, weights, [0, 0, 1, 1], apply_gdpo=False), c, 1e-7)
    scale = math.sqrt(0.8 / 3) / math.sqrt(2)  # the unbiased std of c
    close(pref_grpo_advantages(rewards, weights, [0, 0, 1, 1], apply_gdpo=True), [x / scale for x in c], 1e-7)


def test_the_paper_era_mix_and_equal_rates():
    out = pref_grpo_advantages({"win": THINK, "clip": CLIP}, [0.7, 1.4], IDS, apply_gdpo=False)
    close(out, [0.7 * a + 1.4 * b for a, b in zip(_group(THINK), _group(CLIP))])
    flat = pref_grpo_advantages({"win": [0.5] * 6}, {"win": 1.0}, IDS, apply_gdpo=False)
    assert flat.tolist() == [0.0] * 6  # equal rates give exactly 0
    with pytest.raises(ValueError, match="'clip'"):
        pref_grpo_advantages({"win": THINK}, {"win": 0.4, "clip": 0.6}, IDS, apply_gdpo=True)


@pytest.mark.parametrize("ow, dw", [(1.0, 1.0), (0.3, 0.7), (1.0, 0.0)])
def test_flex_advantage_is_the_blend_of_overall_and_dim_mean_advantages_with_apply_gdpo(ow, dw):
    responses = FLEX_RESPONSES + [(3 + i, 3 + j, _flex(w, ("align", w))) for i, j, w in
                                  [(0, 1, "Image 2"), (0, 2, "Image 2"), (1, 2, "tie")]]
    first = flex_win_rates(3, FLEX_RESPONSES, overall_weight=ow, dim_weight=dw, category_weights=[1.0, 0.7, 0.7])
    second = flex_win_rates(3, [(i - 3, j - 3, t) for i, j, t in responses[3:]], overall_weight=ow, dim_weight=dw,
                            category_weights=[1.0, 0.7, 0.7])
    flex = type(first).cat([first, second])
    out = pref_grpo_advantages({"unifiedreward_flex": flex.rewards, "clip": CLIP},
                               {"unifiedreward_flex": 0.7, "clip": 0.3}, IDS, apply_gdpo=True, flex=flex)
    overall, dim = _group(flex.overall.tolist()), _group(flex.dim_mean.tolist())
    blend = [(ow * o + dw * d) / (ow + dw) if dw > 0 and m else o for o, d, m in zip(overall, dim, flex.mask.tolist())]
    close(out, _batch([0.7 * a + 0.3 * b for a, b in zip(blend, _group(CLIP))]), 1e-10)
    # without apply_gdpo the Flex reward is its blended rates, normalised like any reward
    plain = pref_grpo_advantages({"unifiedreward_flex": flex.rewards, "clip": CLIP}, [0.7, 0.3], IDS, apply_gdpo=False,
                                 flex=flex)
    close(plain, [0.7 * a + 0.3 * b for a, b in zip(_group(flex.rewards.tolist()), _group(CLIP))], 1e-10)


def test_a_group_of_one_gives_nan_as_released():
    out = pref_grpo_advantages({"r": [0.3, 0.5, 0.1]}, [1.0], [0, 0, 1], apply_gdpo=False)
    assert torch.isnan(out[2]) and not torch.isnan(out[:2]).any()


# ------------------------------------------------------------------ the config: reward.combine gdpo
def _load(*overrides):
    return load_config(TrainConfig, PRESET, list(overrides))


def test_the_preset_combines_with_pref_grpos_gdpo_and_a_pairwise_reward():
    config = _load()
    assert (config.reward.combine, config.reward.gdpo_variant, config.data.group_size) == ("gdpo", "pref_grpo", 8)
    assert [(s.name, s.weight) for s in config.reward.rewards] == [("pairwise_preference", 0.4), ("toy_geneval", 0.6)]


@pytest.mark.parametrize("overrides, key, words", [
    (["credit.name=dense"], "reward.combine", "normalises the combined reward per group again"),
    (["reward.gdpo_variant=nvlabs", "reward.rewards=[{name: toy_geneval}]"], "reward.gdpo_aggregation",
     "falls back to GRPO"),
    (["data.group_size=1"], "data.group_size", "must be >= 2"),
])
def test_bad_gdpo_and_pairwise_settings_are_refused_when_the_config_loads(overrides, key, words):
    with pytest.raises(ConfigError, match=words) as error:
        _load(*overrides)
    assert error.value.key == key


def test_one_reward_under_the_other_variants_and_nvlabs_sum_load():
    for overrides in (["reward.gdpo_variant=flow_factory"], ["reward.gdpo_variant=pref_grpo"],
                      ["reward.gdpo_variant=nvlabs", "reward.gdpo_aggregation=sum"]):
        assert _load("reward.rewards=[{name: toy_geneval}]", *overrides).reward.combine == "gdpo"


def test_the_iteration_advantages_leave_invalid_samples_out_and_only_clip_after_gdpo():
    from flowalign.training.scoring import gdpo_iteration_advantages

    raw = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.3, math.nan], [0.5, 0.5, 1.0, 0.0, 0.2, 0.9]])
    valid = torch.isfinite(raw).all(0)
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    config = SimpleNamespace(reward=SimpleNamespace(gdpo_variant="flow_factory", gdpo_aggregation="gdpo",
                                                    gdpo_scale_rewards=True, gdpo_global_std=True),
                             advantage=SimpleNamespace(clip=1.2))
    advantages, stats = gdpo_iteration_advantages(raw, torch.tensor([1.0, 1.0]), valid, ids, config)
    kept = gdpo_advantages(raw[:, :5].double(), [1.0, 1.0], ids[:5], variant="flow_factory")
    close(advantages[:5].double(), kept.clamp(-1.2, 1.2).float().double())
    assert advantages[5] == 0.0  # invalid
    assert abs(float(advantages[4])) < 1e-6  # group 2 has one valid member: no spread
    assert stats["zero_std_frac"] == pytest.approx(1 / 3) and stats["clip_frac"] > 0


# ------------------------------------------------------------------ the pairwise judge over HTTP (127.0.0.1)
def _brightness(url: str) -> float:
    from PIL import Image

    assert url.startswith("data:image/png;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("L")
    return sum(image.getdata()) / (image.width * image.height * 255)


class Judge(BaseHTTPRequestHandler):
    """An OpenAI-compatible judge; the model name picks its behaviour: consistent (the brighter image wins), noisy
    (consistent but for one flipped pair), tied, unparseable, flex (the Flex JSON), huge (an oversized answer)."""

    calls: list = []
    lock = threading.Lock()

    def log_message(self, *args):  # quiet
        pass

    def _send(self, body: dict, status: int = 200):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": "judge"}]})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        parts = request["messages"][-1]["content"]
        first, second = (_brightness(p["image_url"]["url"]) for p in parts[:2])
        text = parts[2]["text"]
        model = request["model"]
        with self.lock:
            self.calls.append((model, round(first, 2), round(second, 2), text))
        better = 1 if first > second else 2
        if model == "noisy" and {round(first, 1), round(second, 1)} == {0.1, 0.3}:
            better = 3 - better
        if model in ("consistent", "noisy"):
            content = f"<think>one is brighter</think><answer>Image {better} is better</answer>"
        elif model == "tied":
            content = "<think>hard to say</think><answer>Both images are equally good</answer>"
        elif model == "unparseable":
            content = "I would rather not say."
        elif model == "flex":
            content = "Here: " + _flex(f"Image {better}", ("brightness", f"Image {better}"), ("size", "tie"))
        else:
            content = "x" * 5000
        self._send({"id": "c", "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})


@pytest.fixture(scope="module")
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


LEVELS = [0.3, 0.1, 0.4, 0.2, 0.5, 0.7, 0.6, 0.9]  # two groups of 4: ranks 2,0,3,1 and 0,2,1,3


def _score(url, model, *, pairing="group", fmt="think", **kwargs):
    from flowalign.rewards import build_reward, score_all

    Judge.calls.clear()
    reward = build_reward("pairwise_preference", judge="vlm", format=fmt, pairing=pairing,
                          judge_kwargs={"url": url, "model": model, "retries": 0, "concurrency": 2, **kwargs})
    images = torch.tensor(LEVELS)[:, None, None, None].expand(8, 3, 8, 8).contiguous()
    prompts = ["a red cube"] * 4 + ["two blue balls"] * 4
    scores = score_all([("pref", 1.0, reward)], images, prompts, [{} for _ in prompts],
                       group_ids=torch.tensor([0] * 4 + [1] * 4))
    return scores.raw[0].double(), reward


def test_a_consistent_judge_over_http_makes_g_g_minus_1_over_2_calls_per_group(judge_url):
    rates, reward = _score(judge_url, "consistent")
    close(rates, [0.667, 0.0, 1.0, 0.333, 0.0, 0.667, 0.333, 1.0], 1e-6)
    assert len(Judge.calls) == 2 * 6 and reward.pairs == 12 and reward.failed == 0
    shown = sorted((first, second) for _, first, second, _ in Judge.calls)
    expected = sorted((round(LEVELS[g + i], 2), round(LEVELS[g + j], 2)) for g in (0, 4)
                      for i, j in itertools.combinations(range(4), 2))
    assert shown == expected  # within groups only, the lower index shown first
    assert all("a red cube" in text or "two blue balls" in text for *_, text in Judge.calls)


def test_noisy_tied_unparseable_and_flex_judges_over_http(judge_url):
    noisy, _ = _score(judge_url, "noisy")  # the (0.3, 0.1) pair flips: image 1 beats image 0
    close(noisy, [0.333, 0.333, 1.0, 0.333, 0.0, 0.667, 0.333, 1.0], 1e-6)
    for model in ("tied", "unparseable"):
        rates, reward = _score(judge_url, model)
        close(rates, [0.5] * 8, 1e-6)
    assert reward.unparsed == 12
    flex, _ = _score(judge_url, "flex", fmt="flex")
    # overall = rank / 3; the brightness category agrees, size ties: dim_mean = (rank / 3 + 0.5) / 2
    ranks = [2, 0, 3, 1, 0, 2, 1, 3]
    close(flex, [(round(r / 3, 3) + round((r / 3 + 0.5) / 2, 3)) / 2 for r in ranks], 1e-6)


def test_the_released_cross_group_pairing_is_asked_for_by_name(judge_url):
    rates, reward = _score(judge_url, "consistent", pairing="rank")
    assert len(Judge.calls) == 8 * 7 // 2 and not reward.groupwise
    close(rates, [round(sorted(LEVELS).index(v) / 7, 3) for v in LEVELS], 1e-6)


def test_an_oversized_answer_is_refused_and_a_call_without_any_answer_is_invalid(judge_url):
    rates, reward = _score(judge_url, "huge", max_answer_bytes=1000)
    assert torch.isnan(rates).all() and reward.failed == 12 and reward.judge.failed == 12


def test_the_judge_is_checked_before_anything_loads(judge_url):
    from flowalign.pairwise_reward import PairwisePreference

    PairwisePreference.check_run({"judge": "vlm", "judge_kwargs": {"url": judge_url, "model": "m"}},
                                 key="reward.rewards[0].kwargs", model=None, image_size=None)
    with pytest.raises(ValueError, match=r"reward.rewards\[0\].kwargs.judge_kwargs.url"):
        PairwisePreference.check_run({"judge": "vlm", "judge_kwargs": {"url": "http://127.0.0.1:9/v1", "model": "m"}},
                                     key="reward.rewards[0].kwargs", model=None, image_size=None)
    with pytest.raises(ValueError, match=r"kwargs.pairing"):
        PairwisePreference.check_run({"judge": "score", "pairing": "batch"}, key="kwargs", model=None,
                                     image_size=None)
    with pytest.raises(ValueError, match=r"judge_kwargs.reward_kwarg is not a setting .* did you mean 'reward_kwargs'"):
        PairwisePreference.check_run({"judge": "score", "judge_kwargs": {"reward_kwarg": {}}}, key="kwargs", model=None,
                                     image_size=None)
    with pytest.raises(ValueError, match=r"kwargs.judge_kwargs.timeot .* did you mean 'timeout'"):
        PairwisePreference.check_run({"judge": "vlm", "judge_kwargs": {"url": judge_url, "model": "m", "timeot": 3}},
                                     key="kwargs", model=None, image_size=None)
    with pytest.raises(ValueError, match="unknown pairwise judge"):
        PairwisePreference.check_run({"judge": "nope"}, key="kwargs", model=None, image_size=None)


def test_a_local_pairwise_model_is_a_registered_callable():
    from flowalign.pairwise_reward import PAIRWISE_JUDGES, register_pairwise_judge
    from flowalign.rewards import build_reward

    seen = []

    def brighter(first, second, prompts, metadata):
        seen.extend(zip(first.mean((1, 2, 3)).tolist(), second.mean((1, 2, 3)).tolist()))
        return [1 if a > b else 2 for a, b in zip(first.mean((1, 2, 3)), second.mean((1, 2, 3)))]

    register_pairwise_judge("test_brighter", lambda: brighter)
    try:
        reward = build_reward("pairwise_preference", judge="test_brighter")
        images = torch.tensor([0.2, 0.6, 0.4])[:, None, None, None].expand(3, 3, 4, 4)
        close(reward(images, ["p"] * 3, [{}] * 3), [0.0, 1.0, 0.5])
        assert len(seen) == 3
        with pytest.raises(ValueError, match="at least two images"):
            reward(images[:1], ["p"], [{}])
    finally:
        PAIRWISE_JUDGES.unregister("test_brighter")


def test_the_toy_stand_in_judge_compares_a_pointwise_reward():
    from flowalign.rewards import build_reward

    reward = build_reward("pairwise_preference", judge="score", judge_kwargs={"reward": "brightness"})
    images = torch.tensor([0.2, 0.6, 0.4, 0.4])[:, None, None, None].expand(4, 3, 4, 4)
    close(reward(images, ["p"] * 4, [{}] * 4), [0.0, 1.0, 0.5, 0.5])  # 2 and 3 tie
