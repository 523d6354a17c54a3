"""Text encoder deployment: batches prompts across requests and caches embeddings by text.

One bad item never fails its batch: a batch that raises is encoded again item by item, and an
item that still fails raises for its own caller only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from ray import serve

from stepserve.actors.denoiser import resolve_device
from stepserve.engine.families import TEXT, ModelSource, load_family
from stepserve.engine.text_encoding import CachedTextEncoder, Pair

Item = tuple[str, str, str | None]  # (model, prompt, negative prompt or None: no CFG)

# Serve writes the "ray.serve" logger to the replica's log, tagged with the request id.
logger = logging.getLogger("ray.serve")


def encode_items(encoder: CachedTextEncoder, items: Sequence[Item]) -> list[Pair | Exception]:
    """One result per item, in order: its embeddings, or the exception encoding it alone raised.

    Each model's items are encoded in one batch; if that raises, each item is encoded alone, so
    only the items that fail by themselves get an exception.
    """
    out: list[Pair | Exception | None] = [None] * len(items)
    for model in dict.fromkeys(m for m, _, _ in items):
        idx = [i for i, item in enumerate(items) if item[0] == model]
        for i, result in zip(idx, _encode_group(encoder, model, [items[i] for i in idx])):
            out[i] = result
    return out


def _encode_group(encoder: CachedTextEncoder, model: str, group: Sequence[Item]) -> list[Pair | Exception]:
    try:
        return _encode_together(encoder, model, group)
    except Exception as exc:
        if len(group) == 1:  # its error is its own: encoding it again would only fail again
            logger.exception("text encoding failed for one item of model %r", model)
            return [exc]
        logger.warning("text encoding failed for a batch of %d items of model %r; retrying them one by one",
                       len(group), model, exc_info=True)
    # Outside the `except`, so an item's own error does not carry the batch's as its context.
    return [_encode_alone(encoder, model, item) for item in group]


def _encode_together(encoder: CachedTextEncoder, model: str, group: Sequence[Item]) -> list[Pair]:
    return encoder.encode_pairs(model, [(prompt, neg) for _, prompt, neg in group])


def _encode_alone(encoder: CachedTextEncoder, model: str, item: Item) -> Pair | Exception:
    try:
        (result,) = _encode_together(encoder, model, [item])
    except Exception as exc:
        logger.exception("text encoding failed for one item of model %r (encoded alone)", model)
        return exc
    return result


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
