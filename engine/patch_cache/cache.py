"""One request's patch cache (PatchedServe §5.1, Fig. 10 step 5): for every block, the image
tokens' input and output as that block last computed them, and counts of what was reused.

A patch's cached input and output are updated together, only when the block computes the patch:
a reused patch keeps the input its cached output was computed from, so the next step measures
how far its input has drifted since then, not since the last step (which would let a slowly
drifting patch be reused forever).

The cache belongs to the request (its `Sampler` holds it), not to a batch: requests join and
leave batches at every step, and rows of different requests never share entries. It is not part
of the request's exported state: a request resumed elsewhere starts with an empty cache and
computes its next step in full. Memory: two [rows, tokens, hidden] tensors per block, in the
model's dtype (SD3-medium at 1024 px in bf16 with CFG: 2 x 24 x 2 x 4096 x 1536 x 2 B = 1.2 GB),
its own (a request stepping in a batch copies its rows out), so it goes when the request does.
"""

from __future__ import annotations

import torch


class PatchCache:
    """Per block b: `inputs[b]`, `outputs[b]` [rows, tokens, hidden] (empty until the request's
    first forward through the patch cache); `steps`: such forwards run; `reused[b]`: patches
    reused in block b, summed over rows and steps; `decided`: patch decisions per block so far
    (rows x patches per step, computed-in-full steps included)."""

    def __init__(self, rows: int):
        if rows < 1:
            raise ValueError(f"a request has at least one row, got {rows}")
        self.rows = rows
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self.steps = 0
        self.reused: torch.Tensor | None = None
        self.decided = 0

    @property
    def filled(self) -> bool:
        return bool(self.outputs)

    def reuse_share(self) -> float:
        """Patches reused over patch decisions, all blocks and steps (PatchedServe Fig. 19's
        computation savings: skipped patches / (patches x blocks x steps)); 0 before any step."""
        if self.reused is None or not self.decided:
            return 0.0
        return float(self.reused.sum()) / (self.decided * len(self.reused))
