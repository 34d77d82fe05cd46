"""The Fréchet distance between two sets of features (FID's formula, in any feature space).

For Gaussians fitted to the two sets (means ``mu_a``, ``mu_b``, covariances ``C_a``, ``C_b``):

    FD = ||mu_a - mu_b||^2 + tr(C_a + C_b - 2 (C_a^{1/2} C_b C_a^{1/2})^{1/2})

computed in float64 with symmetric eigendecompositions (``tr (C_a^{1/2} C_b C_a^{1/2})^{1/2}`` is the sum of the square
roots of that PSD matrix's eigenvalues, negative round-off clipped to 0), so it is exact for PSD inputs and never
complex. Covariances are unbiased (``N - 1``). DRL reports it in the discriminator's frozen feature space.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["frechet_distance", "gaussian_frechet_distance"]


def _psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh((matrix + matrix.T) / 2)
    return (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T


def gaussian_frechet_distance(mu_a, cov_a, mu_b, cov_b) -> float:
    """The Fréchet (2-Wasserstein squared) distance between ``N(mu_a, cov_a)`` and ``N(mu_b, cov_b)``."""
    mu_a, mu_b = np.asarray(mu_a, np.float64).reshape(-1), np.asarray(mu_b, np.float64).reshape(-1)
    cov_a, cov_b = np.atleast_2d(np.asarray(cov_a, np.float64)), np.atleast_2d(np.asarray(cov_b, np.float64))
    if not (mu_a.shape == mu_b.shape and cov_a.shape == cov_b.shape == (mu_a.size, mu_a.size)):
        raise ValueError(f"means {mu_a.shape}, {mu_b.shape} and covariances {cov_a.shape}, {cov_b.shape} do not agree")
    root = _psd_sqrt(cov_a)
    cross = np.linalg.eigvalsh((root @ cov_b @ root + (root @ cov_b @ root).T) / 2)
    value = float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a) + np.trace(cov_b) - 2 * np.sqrt(np.clip(cross, 0, None)).sum())
    return max(value, 0.0)


def frechet_distance(features_a, features_b) -> float:
    """FD between the Gaussians fitted to ``features_a [N, D]`` and ``features_b [M, D]`` (N, M >= 2)."""
    a = features_a.detach().double().cpu().numpy() if isinstance(features_a, torch.Tensor) else np.asarray(features_a, np.float64)
    b = features_b.detach().double().cpu().numpy() if isinstance(features_b, torch.Tensor) else np.asarray(features_b, np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or min(len(a), len(b)) < 2:
        raise ValueError(f"need two [N, D] feature sets with N >= 2 and the same D, got {a.shape} and {b.shape}")
    return gaussian_frechet_distance(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False))
