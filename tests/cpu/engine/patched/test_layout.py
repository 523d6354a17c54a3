"""Patch layouts: the patch side chosen for a batch, per-patch neighbour metadata, and the
split of images into patches and back."""

import pytest
import torch

from stepserve.engine.patched.layout import PatchLayout, from_patches, patch_side, to_patches


def test_patch_side_is_the_gcd_of_all_sides_or_the_configured_one():
    assert patch_side([(64, 64), (96, 96)], 8) == 32
    assert patch_side([(64, 96), (128, 128)], 8) == 32
    assert patch_side([(64, 64), (96, 96)], 8, configured=16) == 16


@pytest.mark.parametrize("sizes,multiple,configured", [
    ([(64, 64), (96, 96)], 8, 24),  # 24 does not divide 64
    ([(20, 20), (30, 30)], 8, None),  # GCD 10 is not a multiple of the UNet's downscale 8
    ([(16, 16)], 8, 4),  # a 4-pixel patch would be half a pixel three downsamplers down
    ([], 8, None),
])
def test_patch_sides_that_cannot_serve_are_refused(sizes, multiple, configured):
    with pytest.raises(ValueError):
        patch_side(sizes, multiple, configured)


def test_layout_offsets_images_and_neighbours():
    layout = PatchLayout.of([(2, 3), (1, 1)], 1)  # a 2x3 grid, then a single patch
    assert layout.grids == ((2, 3), (1, 1))
    assert layout.first_patch == (0, 6, 7) and layout.num_patches == 7
    assert layout.image_of() == [0] * 6 + [1]
    # NEIGHBOUR_OFFSETS order: NW, N, NE, W, E, SW, S, SE
    assert layout.neighbours() == [
        [-1, -1, -1, -1, 1, -1, 3, 4],
        [-1, -1, -1, 0, 2, 3, 4, 5],
        [-1, -1, -1, 1, -1, 4, 5, -1],
        [-1, 0, 1, -1, 4, -1, -1, -1],
        [0, 1, 2, 3, 5, -1, -1, -1],
        [1, 2, -1, 4, -1, -1, -1, -1],
        [-1] * 8,  # an image of one patch has no neighbours: its halo is all border
    ]


def test_images_are_grouped_by_grid_in_order_of_first_appearance():
    layout = PatchLayout.of([(16, 16), (24, 24), (16, 16), (16, 24)], 8)
    assert layout.same_grid() == [[0, 2], [1], [3]]


def test_a_layout_refuses_a_patch_that_does_not_tile():
    with pytest.raises(ValueError):
        PatchLayout.of([(16, 12)], 8)


def test_patches_are_row_major_squares_of_each_image_and_round_trip():
    images = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).view(2, 3, 4, 6)
    patches = to_patches(images, (2, 3))
    assert patches.shape == (12, 3, 2, 2)
    for n in range(2):
        for r in range(2):
            for c in range(3):
                torch.testing.assert_close(patches[n * 6 + r * 3 + c], images[n, :, 2 * r:2 * r + 2, 2 * c:2 * c + 2],
                                           atol=0, rtol=0)
    torch.testing.assert_close(from_patches(patches, (2, 3)), images, atol=0, rtol=0)
