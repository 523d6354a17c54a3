"""Text encoder deployment: batches prompts across requests and caches embeddings by text."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from ray import serve

from ..actors.denoiser import resolve_device
from ..engine.families import TEXT, ModelSource, load_family
from ..engine.text_encoding import CachedTextEncoder

Embeddings = tuple[np.ndarray, np.ndarray | None]  # (prompt [1, seq, dim], negative or None)


class TextEncoder:
    def __init__(self, models: Sequence[ModelSource], device: str = "auto", torch_threads: int | None = None,
                 max_batch_size: int = 16, batch_wait_timeout_s: float = 0.002, cache_size: int = 4096):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        device = resolve_device(device)
        self.encoder = CachedTextEncoder({m.name: load_family(m, {TEXT}, device) for m in models}, cache_size)
        self._encode_batch.set_max_batch_size(max_batch_size)
        self._encode_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    async def encode(self, model: str, prompt: str, negative_prompt: str | None) -> Embeddings:
        """Negative prompt None means no CFG: only the prompt is encoded."""
        return await self._encode_batch((model, prompt, negative_prompt))

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.002)
    async def _encode_batch(self, items: list[tuple[str, str, str | None]]) -> list[Embeddings]:
        out: list[Embeddings | None] = [None] * len(items)
        for model in dict.fromkeys(m for m, _, _ in items):
            idx = [i for i, item in enumerate(items) if item[0] == model]
            texts = [items[i][1] for i in idx] + [items[i][2] for i in idx if items[i][2] is not None]
            embeds = iter(self.encoder.encode(model, texts))
            conds = [next(embeds) for _ in idx]
            for i, cond in zip(idx, conds):
                out[i] = (cond, next(embeds) if items[i][2] is not None else None)
        return out

    def cache_stats(self) -> dict[str, int]:
        return {"hits": self.encoder.hits, "misses": self.encoder.misses}
