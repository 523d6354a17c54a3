"""Prompt → embeddings with an LRU cache keyed by (model, text).

Prompts repeat a lot in serving (templates, the empty negative prompt), and each text is
encoded on its own by the pipeline too, so caching per text changes no result.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from stepserve.engine.families.base import DiffusionFamily


class CachedTextEncoder:
    def __init__(self, families: Mapping[str, DiffusionFamily], cache_size: int = 1024):
        self.families = dict(families)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def encode(self, model: str, texts: Sequence[str]) -> list[np.ndarray]:
        """One [1, seq, dim] float array per text; unseen texts are encoded in one batch."""
        if model not in self.families:
            raise ValueError(f"model {model!r} has no text encoder here")
        missing = list(dict.fromkeys(t for t in texts if (model, t) not in self._cache))
        self.hits += len(texts) - len(missing)
        self.misses += len(missing)
        fresh: dict[str, np.ndarray] = {}
        if missing:
            embeds = self.families[model].encode_text(missing).float().cpu().numpy()
            fresh = {text: embeds[i : i + 1] for i, text in enumerate(missing)}
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
