"""Text encoder deployment: batches prompts across requests and caches embeddings by text.

One bad item never fails its batch (`encode_items`): a batch that raises is encoded again item
by item, and an item that still fails raises for its own caller only. Not built when the
workers encode prompts themselves (`text_encoder.on_workers`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from ray import serve

from stepserve.engine.families import resolve_device
from stepserve.engine.families import TEXT, ModelSource, load_family
from stepserve.engine.text_encoding import CachedTextEncoder, Item, Pair, encode_items


class TextEncoder:
    def __init__(self, models: Sequence[ModelSource], device: str = "auto", torch_threads: int | None = None,
                 max_batch_size: int = 16, batch_wait_timeout_s: float = 0.002, cache_size: int = 4096):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        device = resolve_device(device)
        self.encoder = CachedTextEncoder({m.name: load_family(m, {TEXT}, device) for m in models}, cache_size)
        self._encode_batch.set_max_batch_size(max_batch_size)
        self._encode_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    async def encode(self, model: str, prompt: str, negative_prompt: str | None) -> Pair:
        """Negative prompt None means no CFG: only the prompt is encoded."""
        result = await self._encode_batch((model, prompt, negative_prompt))
        # serve.batch fails every caller of a batch that raises, but hands a returned exception to
        # its own caller as a plain value: raising it here fails this request alone.
        if isinstance(result, Exception):
            raise result
        return result

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.002)
    async def _encode_batch(self, items: list[Item]) -> list[Pair | Exception]:
        return encode_items(self.encoder, items)

    async def ready(self) -> bool:
        """A replica answers only once its constructor, which loads the models, has finished."""
        return True

    def cache_stats(self) -> dict[str, int]:
        return {"hits": self.encoder.hits, "misses": self.encoder.misses}
