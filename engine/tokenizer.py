"""Tokenizers that need no download: a byte-level CLIP one and a character-level T5 one, and
their word-level extensions for the shapes models' captions.

Real model folders ship their own tokenizer; tiny presets use these. Every byte (CLIP: plain and
end-of-word form) or printable character (T5) is a token, so prompts tokenize, deterministically,
offline.
"""

from __future__ import annotations

import string
from collections.abc import Collection

from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTokenizer, T5Tokenizer

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


# T5 (UMT5) side: the Wan family's text encoder reads SentencePiece-style pieces. T5's id layout
# is kept (<pad> 0, </s> 1, <unk> 2); every printable ASCII character is a piece, plain and
# word-initial ("▁a"), so prompts tokenize offline and deterministically; anything else is <unk>.
T5_PAD, T5_EOS, T5_UNK, T5_SPACE = "<pad>", "</s>", "<unk>", "\u2581"


def t5_character_vocab() -> list[tuple[str, float]]:
    """(piece, unigram log-score) pairs; one score per kind keeps segmentation unambiguous."""
    chars = [c for c in string.printable if not c.isspace()]
    vocab = [(T5_PAD, 0.0), (T5_EOS, 0.0), (T5_UNK, 0.0), (T5_SPACE, -2.0)]
    vocab += [(T5_SPACE + c, -3.0) for c in chars]
    vocab += [(c, -3.0) for c in chars]
    return vocab


def character_t5_tokenizer(max_length: int = 512) -> T5Tokenizer:
    return T5Tokenizer(vocab=t5_character_vocab(), extra_ids=0, model_max_length=max_length)


def word_t5_tokenizer(words: Collection[str], max_length: int) -> T5Tokenizer:
    """The character-level T5 tokenizer plus each of `words` as one word-initial piece, scored
    above any spelling of it in characters (the shapes models' caption words); any other word
    still tokenizes, character by character."""
    vocab = t5_character_vocab()
    vocab += [(T5_SPACE + word, -1.0) for word in sorted(words) if len(word) > 1]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)


def word_clip_tokenizer(words: Collection[str], max_length: int) -> CLIPTokenizer:
    """The byte-level CLIP tokenizer plus BPE merges that make each of `words` one token (the
    shapes models' caption words); any other word still tokenizes, byte by byte or in pieces.

    Merges are added until every word comes out whole: a merge made for one word can split
    another word differently (green's "r e" before "g r"), and the next round merges what it left.
    """
    vocab, merges = byte_level_vocab(), []
    for _ in range(64):
        tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)
        split = {word: tokenizer.tokenize(word) for word in sorted(words)}
        pending = [pieces for pieces in split.values() if len(pieces) > 1]
        if not pending:
            return tokenizer
        for pieces in pending:
            left, right = pieces[0], pieces[1]
            if (left, right) not in merges:
                merges.append((left, right))
                vocab.setdefault(left + right, len(vocab))
    raise RuntimeError("word_clip_tokenizer: merges did not settle")
