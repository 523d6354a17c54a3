"""Patch-level cache reuse across denoising steps (PatchedServe §5, §7): each block's output of a
request's patches is kept from one step to the next, and a learned predictor says, per block and
patch, whether this step may reuse it instead of computing it."""
