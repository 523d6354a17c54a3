"""Patched batching for UNet families (PatchedServe §4): latents of different resolutions cut
into square patches that share one UNet forward, with halo exchange for the convolutions and
whole-image regrouping for attention."""

from stepserve.engine.patched.layout import PatchLayout, from_patches, patch_side, to_patches
from stepserve.engine.patched.modules import NormStats
from stepserve.engine.patched.unet import patch_multiple, patched_modules, patched_unet_forward

__all__ = ["NormStats", "PatchLayout", "from_patches", "patch_multiple", "patch_side", "patched_modules",
           "patched_unet_forward", "to_patches"]
