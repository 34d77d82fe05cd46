"""Branch-at-step probes (TempFlow-GRPO): layout, NFEs, exact log-probs, ODE completion, determinism."""

import pytest
import torch

from flowalign.samplers import probe_nfe, probe_rollout, rollout, sde_mean_std

from gaussian_flow import Counting, gaussian_velocity, levels, sigmas


def test_probe_nfes_and_batching():
    velocity = Counting()
    result = probe_rollout(velocity, torch.randn(2, 1, 2, 2), sigmas(6), levels(6), [1, 3], children=4)
    # trunk: 2 prompts x steps 0..3; children: 2 x 4 x ((6 - 1 - 1) + (6 - 3 - 1)) = 8 x 6
    assert result.nfe == probe_nfe(6, [1, 3], 4, prompts=2) == 2 * 4 + 8 * 6
    assert result.nfe == sum(velocity.batches)
    trunk_calls = [rows for _, batch, rows in velocity.calls if rows == [0, 1]]
    assert len(trunk_calls) == 4  # its own call at the prompts' batch size
    assert result.final.shape[0] == 2 * 2 * 4 and len(result.transitions) == 16


def test_probe_layout_groups_and_steps():
    result = probe_rollout(Counting(), torch.randn(3, 1, 2, 2), sigmas(5), levels(5), [0, 2], children=2,
                           prompt_ids=torch.tensor([10, 11, 12]))
    t = result.transitions
    # completion index (p * 2 + b) * 2 + k
    assert t.step.tolist() == [0, 0, 2, 2] * 3
    assert t.prompt_id.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert t.group_id.tolist() == [20, 20, 21, 21, 22, 22, 23, 23, 24, 24, 25, 25]
    assert torch.equal(t.sample_id, torch.arange(12))
    assert bool(t.stochastic.all())
    # Siblings share their trunk source; different probes have different sources.
    assert t.src[0] == t.src[1] and t.src[0] != t.src[2]


def test_probe_edges_have_exact_log_probs_and_completions_are_the_ode():
    s = sigmas(6)
    x_init = torch.randn(2, 1, 3, 3, generator=torch.Generator().manual_seed(0))
    result = probe_rollout(Counting(), x_init, s, levels(6), [2], children=3, generator=torch.Generator().manual_seed(1))
    t = result.transitions
    # The trunk state at step 2 is the ODE from x_init.
    trunk = rollout(gaussian_velocity, x_init, s[:3], torch.zeros(2)).final
    torch.testing.assert_close(t.x_t, trunk.repeat_interleave(3, 0))
    mean, std = sde_mean_std(t.x_t, gaussian_velocity(t.x_t, s[2]), s[2], s[3], kind="flow_grpo", noise_level=0.7)
    expected = torch.distributions.Normal(mean, std).log_prob(t.x_next).mean(dim=(1, 2, 3))
    torch.testing.assert_close(t.log_prob, expected)
    # Each completion is the ODE from its child.
    completed = rollout(gaussian_velocity, t.x_next, s[3:], torch.zeros(3)).final
    torch.testing.assert_close(result.final, completed)


def test_probe_children_of_a_prompt_do_not_depend_on_the_other_prompts():
    x_init = torch.randn(3, 1, 2, 2, generator=torch.Generator().manual_seed(2))
    gens = lambda keys: [torch.Generator().manual_seed(50 + k) for k in keys]  # noqa: E731
    together = probe_rollout(Counting(), x_init, sigmas(4), levels(4), [0, 1], 2, generator=gens([0, 1, 2]))
    alone = probe_rollout(Counting(), x_init[2:], sigmas(4), levels(4), [0, 1], 2, generator=gens([2]))
    torch.testing.assert_close(together.final[8:], alone.final)


@pytest.mark.parametrize("steps, message", [([], "empty"), ([2, 1], "increasing"), ([0, 9], "past the last"),
                                            ([4], "noise level 0")])
def test_bad_probe_steps(steps, message):
    with pytest.raises(ValueError, match=message):
        probe_rollout(Counting(), torch.zeros(1, 1, 1, 1), sigmas(5), levels(5), steps, 2)
