"""Attention over sequences of different lengths packed along one token axis (PatchedServe §4):
each sequence's queries attend over its own keys and values only, as if it ran alone.

A mixed-resolution batch of a DiT runs every token-wise layer once over the tokens of all its
images, concatenated; attention is the one operation that must not cross images. Sequences
are given by their lengths (host ints: slicing by them needs no device sync), queries and keys
separately, since a block may drop its text queries while keeping text keys.

The fast path slices the packed tensors into runs of consecutive sequences of equal lengths
(the rows of one request under CFG, or requests of one resolution placed together) and runs
one batched `masked_query_attention` per run: torch's SDPA restricted as that module explains
(no cuDNN, whose per-shape plans would be rebuilt for every mix of resolutions), on views of
the packed tensors. The reference is the explicit float32 softmax over the whole packed batch
with a block-diagonal mask, which the fast path is tested against. flash-attention's varlen
kernel (`torch.nn.attention.varlen.varlen_attn`, CUDA and half precision only) would serve all
runs in one call; it is not used here because it cannot be tested on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from stepserve.kernels.masked_attention import masked_query_attention


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lengths: Sequence[int],
                     kv_lengths: Sequence[int]) -> torch.Tensor:
    """softmax(q_i k_i^T / sqrt(d)) v_i for each sequence i, packed: q [sum(q_lengths), heads, d],
    k, v [sum(kv_lengths), heads, d], sequence i's tokens following sequence i-1's. Returns
    [sum(q_lengths), heads, d] in q's layout."""
    _check(q, k, v, q_lengths, kv_lengths)
    heads, d = q.shape[1:]
    outputs, q_start, kv_start = [], 0, 0
    for count, q_len, kv_len in _runs(q_lengths, kv_lengths):
        # [count * len, heads, d] -> [count, heads, len, d]: views of packed tensors, as SDPA reads any strides.
        run_q = q[q_start:q_start + count * q_len].reshape(count, q_len, heads, d).transpose(1, 2)
        run_k = k[kv_start:kv_start + count * kv_len].reshape(count, kv_len, heads, d).transpose(1, 2)
        run_v = v[kv_start:kv_start + count * kv_len].reshape(count, kv_len, heads, d).transpose(1, 2)
        outputs.append(masked_query_attention(run_q, run_k, run_v).transpose(1, 2).reshape(-1, heads, d))
        q_start += count * q_len
        kv_start += count * kv_len
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def reference_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lengths: Sequence[int],
                               kv_lengths: Sequence[int]) -> torch.Tensor:
    """The same attention as one float32 softmax over all packed tokens, each query masked to its
    own sequence's keys (a block-diagonal mask), in q's dtype."""
    _check(q, k, v, q_lengths, kv_lengths)
    q_seq = torch.repeat_interleave(torch.arange(len(q_lengths)), torch.tensor(q_lengths)).to(q.device)
    kv_seq = torch.repeat_interleave(torch.arange(len(kv_lengths)), torch.tensor(kv_lengths)).to(q.device)
    scores = q.float().transpose(0, 1) @ k.float().permute(1, 2, 0) / math.sqrt(q.shape[-1])  # [heads, Nq, Nk]
    scores = scores.masked_fill(q_seq[:, None] != kv_seq[None, :], float("-inf"))
    return (scores.softmax(dim=-1) @ v.float().transpose(0, 1)).transpose(0, 1).to(q.dtype)


def _runs(q_lengths: Sequence[int], kv_lengths: Sequence[int]) -> list[tuple[int, int, int]]:
    """(count, query length, key length) of each run of consecutive sequences with equal lengths."""
    runs: list[tuple[int, int, int]] = []
    for q_len, kv_len in zip(q_lengths, kv_lengths):
        if runs and runs[-1][1:] == (q_len, kv_len):
            runs[-1] = (runs[-1][0] + 1, q_len, kv_len)
        else:
            runs.append((1, q_len, kv_len))
    return runs


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lengths: Sequence[int],
           kv_lengths: Sequence[int]) -> None:
    # Wrong lengths would silently attend across sequences (or drop tokens) rather than fail.
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"expected q [Nq, heads, d] and k, v [Nk, heads, d]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if (len(q_lengths) != len(kv_lengths) or not q_lengths or min(q_lengths) < 1 or min(kv_lengths) < 1
            or sum(q_lengths) != q.shape[0] or sum(kv_lengths) != k.shape[0]):
        raise ValueError(f"sequence lengths {list(q_lengths)} (queries), {list(kv_lengths)} (keys) do not pack "
                         f"{q.shape[0]} queries and {k.shape[0]} keys, one or more tokens each")
