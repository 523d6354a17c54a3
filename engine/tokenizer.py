"""A CLIP tokenizer that needs no download: byte-level vocabulary, no merges.

Real model folders ship their own tokenizer; tiny presets use this one. Every byte maps to a
token (plain and end-of-word form), so any prompt tokenizes, deterministically, offline.
"""

from __future__ import annotations

from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTokenizer

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def byte_level_vocab() -> dict[str, int]:
    vocab = {BOS: 0, EOS: 1}
    alphabet = sorted(ByteLevel.alphabet())
    for char in alphabet:
        vocab[char] = len(vocab)
    for char in alphabet:
        vocab[char + "</w>"] = len(vocab)
    return vocab


def byte_level_clip_tokenizer(max_length: int = 77) -> CLIPTokenizer:
    return CLIPTokenizer(vocab=byte_level_vocab(), merges=[], model_max_length=max_length)
