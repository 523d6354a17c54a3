"""How close an approximate image is to the exact one: PSNR and SSIM, for every approximation
switch (late LoRA, stale ControlNet, ...). Images are float arrays in [0, 1], [H, W, C].

SSIM is Wang et al.'s with scikit-image's defaults (7x7 uniform window, K1 0.01, K2 0.03, sample
covariance), averaged over pixels and channels; numpy only.
"""

from __future__ import annotations

import math

import numpy as np

WINDOW = 7


def psnr(image: np.ndarray, reference: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB (inf when equal)."""
    mse = float(np.mean((np.asarray(image, np.float64) - np.asarray(reference, np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(image: np.ndarray, reference: np.ndarray) -> float:
    """Mean structural similarity (1 when equal)."""
    x, y = (np.asarray(a, np.float64) for a in (image, reference))
    if x.shape != y.shape or x.ndim != 3 or min(x.shape[:2]) < WINDOW:
        raise ValueError(f"need two [H, W, C] images of one shape, sides >= {WINDOW}; got {x.shape}, {y.shape}")
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    n = WINDOW * WINDOW
    cov = n / (n - 1)  # sample covariance, as scikit-image
    mx, my = _mean(x), _mean(y)
    vx, vy, vxy = (cov * (_mean(a * b) - ma * mb) for a, b, ma, mb in ((x, x, mx, mx), (y, y, my, my), (x, y, mx, my)))
    s = ((2 * mx * my + c1) * (2 * vxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return float(s.mean())


def _mean(a: np.ndarray) -> np.ndarray:
    """Mean over each WINDOW x WINDOW window that fits inside the image ("valid"), per channel."""
    c = np.cumsum(np.cumsum(np.pad(a, ((1, 0), (1, 0), (0, 0))), axis=0), axis=1)
    w = WINDOW
    return (c[w:, w:] - c[:-w, w:] - c[w:, :-w] + c[:-w, :-w]) / (w * w)
