"""Mixed-resolution batching by token concatenation (PatchedServe §4, for DiTs): one denoiser
forward over requests of different resolutions, their image tokens packed along one axis."""
