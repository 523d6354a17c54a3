"""Attention of a subset of query tokens over all keys and values (InstGenIE §3.1), and the
gather/scatter pair that moves a token subset out of and back into a full sequence.

A mask-aware transformer block projects queries only for the masked image tokens but attends
over every token's key and value, as an LLM's decode step does for its new token. Softmax is
taken per query row, so each masked query's output is exactly what the full attention gives
that row: no mask on the scores is needed.

Padding rule for a batch of rows with different masked counts: the index is [B, M] with M the
largest count, each shorter row padded by repeating its own first masked token. A duplicated
query computes the same row again, so scattering the subset back writes identical values to
that token and stays exact; the rows stay rectangular, so one batched kernel call serves them.

The fast path is torch's scaled_dot_product_attention restricted to the flash / memory-efficient
kernels on GPU (they accept a query length different from the key length, and any strides with
contiguous head features). Not cuDNN's: it builds an execution plan per shape, and the masked
query count changes from batch to batch; measured on an H100 (torch 2.11, SD3-medium, bf16),
with nine query shapes alternating, a masked forward took 45 ms instead of 24 ms with it, and
with flash 23 ms. The reference is the explicit softmax(QK^T / sqrt(d)) V in float32 it is tested
against. There is no Triton version: SDPA already covers this shape, and Triton is not installed
where it could be tested on CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Every backend but cuDNN's (see the module docstring); math takes what the others refuse.
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def masked_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for q [B, heads, M, d] over k, v [B, heads, L, d]: [B, heads, M, d]."""
    _check_shapes(q, k, v)
    with sdpa_kernel(_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)


def reference_masked_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same attention spelled out in float32 (what the fast path is checked against), in q's dtype."""
    _check_shapes(q, k, v)
    scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    # SDPA would broadcast mismatched batch or head dimensions silently; a caller mixing up
    # [B, L, heads, d] and [B, heads, L, d] should fail here instead.
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"expected q [B, heads, M, d] and k, v [B, heads, L, d]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, L, H] at the token positions index [B, M] (per row): [B, M, H]."""
    return torch.gather(x, 1, _expanded(index, x))


def scatter_tokens(base: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A copy of base [B, L, H] with values [B, M, H] written at index [B, M]; base is left as is
    (it is usually a cached activation that later requests reuse)."""
    return base.scatter(1, _expanded(index, base), values.to(base.dtype))


def write_tokens(base: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """base [B, N, H] with values [B, M, H] written at index [B, M], in place, and returned: for a
    tensor the caller has just made (a join of a cache and other tokens), saving the copy
    `scatter_tokens` makes."""
    return base.scatter_(1, _expanded(index, base), values.to(base.dtype))


def _expanded(index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """index [B, M] broadcast over x's hidden size; refuses an index with other rows than x, which
    torch.gather and scatter would accept silently (they only need index <= x per dimension)."""
    if index.dim() != 2 or x.dim() != 3 or index.shape[0] != x.shape[0]:
        raise ValueError(f"expected x [B, L, H] and index [B, M]; got {tuple(x.shape)}, {tuple(index.shape)}")
    return index.unsqueeze(-1).expand(-1, -1, x.shape[-1])
