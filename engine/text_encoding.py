"""Prompt → embeddings with an LRU cache keyed by (model, text), and the encoding of a batch of
requests' texts in which one bad item fails only itself.

Prompts repeat a lot in serving (templates, the empty negative prompt), and each text is
encoded on its own by the pipeline too, so caching per text changes no result. Used by the text
encoder deployment and, with `text_encoder.on_workers`, by each denoiser worker.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from stepserve.engine.families.base import DiffusionFamily, RowConditioning
from stepserve.engine.sampler import Conditioning
from stepserve.policies.types import RequestKind, RequestSpec

Embeddings = dict[str, np.ndarray]  # one text's `TextEmbeddings`, as float32 arrays [1, ...]
Pair = tuple[Embeddings, Embeddings | None]  # (prompt, negative prompt or None: no CFG)
Item = tuple[str, str, str | None]  # (model, prompt, negative prompt or None: no CFG)

logger = logging.getLogger("stepserve.text_encoding")


class CachedTextEncoder:
    def __init__(self, families: Mapping[str, DiffusionFamily], cache_size: int = 1024):
        self.families = dict(families)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Embeddings] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def encode(self, model: str, texts: Sequence[str]) -> list[Embeddings]:
        """One embedding per text; unseen texts are encoded in one batch."""
        if model not in self.families:
            raise ValueError(f"model {model!r} has no text encoder here")
        missing = list(dict.fromkeys(t for t in texts if (model, t) not in self._cache))
        self.hits += len(texts) - len(missing)
        self.misses += len(missing)
        fresh: dict[str, Embeddings] = {}
        if missing:
            embeds = {name: value.float().cpu().numpy()
                      for name, value in self.families[model].encode_text(missing).items()}
            fresh = {text: {name: value[i : i + 1] for name, value in embeds.items()} for i, text in enumerate(missing)}
        out = []
        for text in texts:
            key = (model, text)
            value = fresh[text] if text in fresh else self._cache[key]
            self._cache[key] = value
            self._cache.move_to_end(key)
            out.append(value)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return out

    def encode_pairs(self, model: str, pairs: Sequence[tuple[str, str | None]]) -> list[Pair]:
        """Each (prompt, negative prompt or None) pair's embeddings, all texts in one batch. A
        negative prompt the family conditions as zeros (`DiffusionFamily.zero_negative`) is not
        encoded."""
        family = self.families.get(model)
        if family is None:
            raise ValueError(f"model {model!r} has no text encoder here")
        encoded = [neg for _, neg in pairs if neg is not None and not family.zero_negative(neg)]
        embeds = iter(self.encode(model, [prompt for prompt, _ in pairs] + encoded))
        conds = [next(embeds) for _ in pairs]
        out: list[Pair] = []
        for cond, (_, neg) in zip(conds, pairs):
            if neg is None:
                out.append((cond, None))
            elif family.zero_negative(neg):
                out.append((cond, {name: np.zeros_like(value) for name, value in cond.items()}))
            else:
                out.append((cond, next(embeds)))
        return out


def text_item(spec: RequestSpec) -> Item:
    """What a request asks the text encoder for: its prompt, and its negative prompt under CFG."""
    return spec.model, spec.prompt, spec.negative_prompt if spec.uses_cfg else None


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


def encode_conditioning(family: DiffusionFamily, spec: RequestSpec) -> Conditioning:
    """A request's conditioning encoded in this process, as a worker gets it from the text
    encoder deployment (tests, profiles and benchmarks that run a family directly)."""
    return Conditioning.from_numpy(*encode_pair(family, spec))


def encode_pair(family: DiffusionFamily, spec: RequestSpec) -> Pair:
    """The text encoder deployment's answer for `spec`, encoded in this process."""
    model, prompt, negative = text_item(spec)
    (pair,) = CachedTextEncoder({model: family}, 0).encode_pairs(model, [(prompt, negative)])
    return pair


def embed(family: DiffusionFamily, text: str) -> Embeddings:
    """One text's embeddings, encoded in this process."""
    return CachedTextEncoder({family.source.name: family}, 0).encode(family.source.name, [text])[0]


def conditioning_rows(family: DiffusionFamily, text: Embeddings, rows: int, height: int, width: int,
                      frames: int = 1) -> RowConditioning:
    """`rows` rows of one text's conditioning for a forward at that size (profiles time forwards
    of every batch shape)."""
    frames = frames if family.kind is RequestKind.T2V else 1
    spec = RequestSpec("rows", family.source.name, "", width, height, 1, 1.0, 0, kind=family.kind, num_frames=frames)
    rows_of = {name: torch.from_numpy(value).to(device=family.device, dtype=family.dtype)
               .expand(rows, *value.shape[1:]).contiguous() for name, value in text.items()}
    return family.row_conditioning(spec, rows_of)
