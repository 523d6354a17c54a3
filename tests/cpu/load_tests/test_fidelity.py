import math

import numpy as np
import pytest

from stepserve.load_tests.fidelity import psnr, ssim


def test_equal_images_are_perfect_and_noise_lowers_both():
    rng = np.random.default_rng(0)
    image = rng.random((32, 48, 3))
    assert psnr(image, image) == math.inf and ssim(image, image) == pytest.approx(1.0)
    small, large = (np.clip(image + rng.normal(0, s, image.shape), 0, 1) for s in (0.01, 0.1))
    assert psnr(small, image) > psnr(large, image) > 0
    assert 1 > ssim(small, image) > ssim(large, image)
    assert psnr(image * 0 + 0.5, image * 0 + 0.6) == pytest.approx(20.0)  # MSE 0.01


def test_ssim_sees_structure_that_psnr_does_not():
    """A constant shift keeps structure (high SSIM); noise of the same MSE destroys it."""
    rng = np.random.default_rng(1)
    image = np.clip(rng.random((40, 40, 1)) * 0.5 + 0.25, 0, 1)
    shifted = image + 0.05
    noisy = image + rng.choice([-0.05, 0.05], image.shape)
    assert psnr(shifted, image) == pytest.approx(psnr(noisy, image))
    assert ssim(shifted, image) > 0.95 > ssim(noisy, image)


def test_ssim_refuses_mismatched_or_tiny_images():
    with pytest.raises(ValueError):
        ssim(np.zeros((8, 8, 3)), np.zeros((8, 9, 3)))
    with pytest.raises(ValueError):
        ssim(np.zeros((5, 5, 3)), np.zeros((5, 5, 3)))
