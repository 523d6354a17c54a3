"""Mask-aware editing (InstGenIE §3.1): denoiser forwards that compute only the masked image
tokens and take the rest from a template's cached activations."""
