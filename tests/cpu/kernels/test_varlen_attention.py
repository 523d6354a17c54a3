"""The varlen attention kernel against its block-diagonal float32 reference and against full
attention of each sequence alone: packing never lets a query see another sequence's keys."""

import pytest
import torch
import torch.nn.functional as F

from stepserve.kernels.varlen_attention import reference_varlen_attention, varlen_attention

# Runs of equal lengths (batched together), a lone sequence, and queries shorter than keys
# (a block whose text queries are dropped).
Q_LENGTHS = (5, 5, 9, 3, 3, 3, 1)
KV_LENGTHS = (7, 7, 9, 6, 6, 6, 4)


def _packed(lengths, heads=3, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lengths), heads, d, generator=g).to(dtype)


def _qkv(q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS, dtype=torch.float32):
    return _packed(q_lengths, dtype=dtype, seed=0), _packed(kv_lengths, dtype=dtype, seed=1), \
        _packed(kv_lengths, dtype=dtype, seed=2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fast_path_matches_reference(dtype, tol):
    q, k, v = _qkv(dtype=dtype)
    out = varlen_attention(q, k, v, Q_LENGTHS, KV_LENGTHS)
    assert out.shape == q.shape and out.dtype == dtype
    expected = reference_varlen_attention(q, k, v, Q_LENGTHS, KV_LENGTHS)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kernel", [varlen_attention, reference_varlen_attention])
def test_each_sequence_equals_its_full_attention_alone(kernel):
    q, k, v = _qkv()
    out = kernel(q, k, v, Q_LENGTHS, KV_LENGTHS)
    q_start = kv_start = 0
    for q_len, kv_len in zip(Q_LENGTHS, KV_LENGTHS):
        alone = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (
            q[q_start:q_start + q_len], k[kv_start:kv_start + kv_len], v[kv_start:kv_start + kv_len])))
        torch.testing.assert_close(out[q_start:q_start + q_len], alone[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        q_start, kv_start = q_start + q_len, kv_start + kv_len


def test_one_sequence_is_plain_attention():
    q, k, v = _qkv((6,), (6,))
    full = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(varlen_attention(q, k, v, (6,), (6,)), full, atol=1e-6, rtol=0)


@pytest.mark.parametrize("q_lengths,kv_lengths", [
    ((5, 5, 9, 3, 3, 3), KV_LENGTHS),  # one sequence short
    ((5, 5, 9, 3, 3, 3, 2), KV_LENGTHS),  # lengths do not add up to the queries
    ((0, 10, 9, 3, 3, 3, 1), KV_LENGTHS),  # an empty sequence
])
def test_lengths_that_do_not_pack_are_refused(q_lengths, kv_lengths):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="do not pack"):
        varlen_attention(q, k, v, q_lengths, kv_lengths)


def test_a_batched_layout_is_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="expected q"):
        varlen_attention(q[None], k[None], v[None], Q_LENGTHS, KV_LENGTHS)
