"""Compute ops, each with a torch reference (masked attention, patch stitching + GroupNorm, ...).

Empty until an issue needs a fused op: the SD1.5 path runs diffusers' own modules unchanged.
"""
