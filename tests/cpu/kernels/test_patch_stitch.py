"""Patch edge stitching fused with GroupNorm, against the unpatched operators on whole images: a
3x3 convolution with padding 0 over stitched patches equals the padded convolution over each
image, and per-image statistics make the fused GroupNorm exact; per-patch statistics do not."""

import pytest
import torch
import torch.nn.functional as F

from stepserve.engine.patched.layout import PatchLayout, from_patches, to_patches
from stepserve.kernels.patch_stitch import group_norm_stitch, reference_group_norm_stitch, stitch_halo

# Three images of different latent sizes (one not square), patch side 4: 6 + 4 + 3 patches.
SIZES = [(12, 8), (8, 8), (4, 12)]
PATCH = 4
CHANNELS, GROUPS = 6, 3


def _images(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, CHANNELS, h, w, generator=g) * 2 + 0.5).to(dtype) for h, w in SIZES]


def _patched(images, layout):
    return torch.cat([to_patches(image, grid) for image, grid in zip(images, layout.grids)])


def _unpatched(patches, layout):
    first = layout.first_patch
    return [from_patches(patches[first[i]:first[i + 1]], grid) for i, grid in enumerate(layout.grids)]


def _metadata():
    layout = PatchLayout.of(SIZES, PATCH)
    return layout, torch.tensor(layout.neighbours()), torch.tensor(layout.image_of())


@pytest.mark.parametrize("stride", [1, 2])
def test_convolution_over_stitched_patches_equals_padded_convolution_over_images(stride):
    """Stride 2 is the downsamplers' convolution: even patch offsets keep its windows aligned."""
    layout, neighbours, _ = _metadata()
    images = _images()
    weight = torch.randn(5, CHANNELS, 3, 3, generator=torch.Generator().manual_seed(1))
    padded = stitch_halo(_patched(images, layout), neighbours)
    assert padded.shape == (layout.num_patches, CHANNELS, PATCH + 2, PATCH + 2)
    out = _unpatched(F.conv2d(padded, weight, stride=stride), layout)
    for got, image in zip(out, images):
        torch.testing.assert_close(got, F.conv2d(image, weight, stride=stride, padding=1), atol=1e-5, rtol=1e-5)


def test_halo_is_zero_at_borders_and_corners_come_from_diagonal_neighbours():
    """A 2x2 grid of 1x1 patches with values 1..4: each padded patch shows the whole image around it."""
    layout = PatchLayout.of([(2, 2)], 1)
    x = torch.arange(1.0, 5.0).view(4, 1, 1, 1)
    padded = stitch_halo(x, torch.tensor(layout.neighbours()))
    image = F.pad(torch.arange(1.0, 5.0).view(2, 2), (1, 1, 1, 1))
    for p in range(4):
        r, c = divmod(p, 2)
        torch.testing.assert_close(padded[p, 0], image[r:r + 3, c:c + 3], atol=0, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_per_image_group_norm_stitch_then_conv_equals_group_norm_and_conv_on_whole_images(dtype, tol):
    """The fused op feeding SiLU and a padding-0 conv, as in a ResnetBlock2D, against nn.GroupNorm ->
    SiLU -> padded conv on each image alone (in float32)."""
    layout, neighbours, owner = _metadata()
    images = _images(dtype=dtype)
    g = torch.Generator().manual_seed(2)
    norm = torch.nn.GroupNorm(GROUPS, CHANNELS, eps=1e-5)
    norm.weight.data, norm.bias.data = torch.randn(CHANNELS, generator=g), torch.randn(CHANNELS, generator=g)
    weight = torch.randn(4, CHANNELS, 3, 3, generator=g)
    with torch.no_grad():
        padded = group_norm_stitch(_patched(images, layout), neighbours, GROUPS, norm.weight.to(dtype),
                                   norm.bias.to(dtype), norm.eps, owner)
        assert padded.dtype == dtype
        out = _unpatched(F.conv2d(F.silu(padded.float()), weight), layout)
        for got, image in zip(out, images):
            expected = F.conv2d(F.silu(norm(image.float())), weight, padding=1)
            torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_per_patch_statistics_are_each_patchs_own_group_norm_and_not_exact():
    """owner=None is PatchedServe's stitcher: every patch normalized alone, its halo its neighbours'
    own normalized edges; the seams then differ from the whole image's GroupNorm."""
    layout, neighbours, owner = _metadata()
    patches = _patched(_images(), layout)
    weight, bias = torch.randn(CHANNELS), torch.randn(CHANNELS)
    per_patch = group_norm_stitch(patches, neighbours, GROUPS, weight, bias, 1e-5, None)
    expected = stitch_halo(F.group_norm(patches, GROUPS, weight, bias, 1e-5), neighbours)
    torch.testing.assert_close(per_patch, expected, atol=1e-5, rtol=1e-5)
    exact = group_norm_stitch(patches, neighbours, GROUPS, weight, bias, 1e-5, owner)
    assert (per_patch - exact).abs().max() > 0.05


def test_one_patch_per_image_makes_per_patch_statistics_exact():
    layout = PatchLayout.of(SIZES[1:2] * 3, 8)  # three 8x8 images, one patch each
    neighbours = torch.tensor(layout.neighbours())
    x = torch.randn(3, CHANNELS, 8, 8)
    torch.testing.assert_close(group_norm_stitch(x, neighbours, GROUPS, None, None, 1e-5, None),
                               group_norm_stitch(x, neighbours, GROUPS, None, None, 1e-5, torch.arange(3)),
                               atol=1e-6, rtol=0)


def test_public_op_equals_the_reference():
    layout, neighbours, owner = _metadata()
    patches = _patched(_images(seed=3), layout)
    args = (GROUPS, torch.randn(CHANNELS), torch.randn(CHANNELS), 1e-6)
    for who in (owner, None):
        torch.testing.assert_close(group_norm_stitch(patches, neighbours, *args, who),
                                   reference_group_norm_stitch(patches, neighbours, *args, who), atol=1e-6, rtol=0)


def test_bad_shapes_are_refused():
    layout, neighbours, owner = _metadata()
    patches = _patched(_images(), layout)
    with pytest.raises(ValueError):
        stitch_halo(patches, neighbours[:, :4])
    with pytest.raises(ValueError):
        stitch_halo(patches[:, 0], neighbours)
    with pytest.raises(ValueError):
        group_norm_stitch(patches, neighbours, 4, None, None, 1e-5, owner)  # 6 channels, 4 groups
