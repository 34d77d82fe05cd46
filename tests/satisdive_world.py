"""A small analytic world for SatisDive's reference cases (tests/test_satisdive.py).

Latents are ``[n, 4, 3]`` (four tokens of three channels). ``velocity_and_feature(x, sigma)`` gives a velocity and a
6-dimensional unit feature from one "forward"; ``decode`` maps a clean latent to a ``[n, 3, 2, 2]`` image in (0, 1),
and ``reward`` scores images. All three are smooth, so gradients flow as through a transformer, a VAE and a reward
model. The fixed matrices are closed-form (sines), so the same world is rebuilt anywhere without stored weights: the
numbers in tests/data/satisdive_reference_cases.json were computed by running the reference implementation on it.
"""

import torch
import torch.nn.functional as F

SHAPE = (4, 3)


def _matrix(rows, cols, freq, phase, scale):
    index = torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols)
    return (scale * torch.sin(freq * index + phase)).float()


W_V = _matrix(12, 12, 0.37, 0.1, 0.5)
W_F = _matrix(12, 6, 0.53, 0.7, 0.8)
W_D = _matrix(12, 12, 0.29, 1.3, 0.6)
C_R = _matrix(1, 12, 0.71, 0.4, 1.0)


def velocity_and_feature(x, sigma):
    """``(v [n, 4, 3], phi [n, 6])`` at latents ``x`` and sigma ``sigma`` (a float or a 0-d tensor)."""
    flat = x.reshape(x.shape[0], -1).float()
    s = float(sigma)
    v = torch.tanh(flat @ W_V) * (1.5 - s) + 0.3 * s * flat - 0.2
    feature = torch.tanh(flat @ W_F + 2.0 * s)
    return v.reshape(x.shape), F.normalize(feature, dim=-1)


def decode(x0):
    return torch.sigmoid(x0.reshape(x0.shape[0], -1).float() @ W_D).reshape(x0.shape[0], 3, 2, 2)


def reward(images):
    flat = images.reshape(images.shape[0], -1)
    return 3.0 * (flat * C_R).sum(dim=1) - 4.0 * ((flat - 0.5) ** 2).mean(dim=1)


def sampler_callables():
    """``(velocity_features, guide_reward)`` in the form ``flowalign.samplers.satisdive`` takes."""

    def velocity_features(x, sigma, rows):
        return velocity_and_feature(x, sigma)

    def guide_reward(x0, rows):
        return reward(decode(x0))

    velocity_features.evals_per_sample = 1
    return velocity_features, guide_reward
