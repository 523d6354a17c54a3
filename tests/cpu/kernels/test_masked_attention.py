"""The masked-query attention kernel against its float32 reference, and the padding rule: a row
padded with duplicates of its first masked token computes and scatters back exactly."""

import pytest
import torch
import torch.nn.functional as F

from stepserve.kernels.masked_attention import (
    gather_tokens, masked_query_attention, reference_masked_query_attention, scatter_tokens, write_tokens,
)


def _qkv(batch=2, heads=3, queries=5, keys=11, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, d, generator=g).to(dtype) for n in (queries, keys, keys))
    return q, k, v


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fast_path_matches_reference(dtype, tol):
    q, k, v = _qkv(dtype=dtype)
    out = masked_query_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), reference_masked_query_attention(q, k, v).float(), atol=tol, rtol=tol)


def test_subset_of_queries_equals_those_rows_of_full_attention():
    """Softmax is per query row, so a subset of queries needs no score mask."""
    x_q, k, v = _qkv(queries=11)
    index = torch.tensor([[1, 4, 7], [0, 2, 10]])
    subset = torch.stack([x_q[b, :, index[b]] for b in range(2)])
    full = F.scaled_dot_product_attention(x_q, k, v)
    torch.testing.assert_close(masked_query_attention(subset, k, v),
                               torch.stack([full[b, :, index[b]] for b in range(2)]), atol=1e-6, rtol=0)


def test_shape_mismatch_is_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError):
        masked_query_attention(q.transpose(1, 2), k, v)  # [B, M, heads, d] by mistake


def test_an_index_for_other_rows_is_refused():
    with pytest.raises(ValueError):
        gather_tokens(torch.zeros(2, 6, 4), torch.tensor([[0, 1]]))  # torch.gather would take it


def test_gather_then_scatter_round_trips_and_leaves_base_alone():
    x = torch.randn(2, 6, 4)
    base = torch.zeros(2, 6, 4)
    index = torch.tensor([[0, 3], [5, 1]])
    picked = gather_tokens(x, index)
    torch.testing.assert_close(picked, torch.stack([x[0, [0, 3]], x[1, [5, 1]]]), atol=0, rtol=0)
    out = scatter_tokens(base, index, picked)
    assert torch.count_nonzero(base) == 0
    expected = base.clone()
    expected[0, [0, 3]], expected[1, [5, 1]] = x[0, [0, 3]], x[1, [5, 1]]
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_write_tokens_writes_in_place_what_scatter_tokens_copies():
    """The same values as the copy, into the caller's tensor, duplicates (a padded row) included."""
    base = torch.randn(2, 8, 4)
    index = torch.tensor([[0, 3], [5, 5]])
    values = torch.randn(2, 2, 4)
    values[1, 1] = values[1, 0]  # a padded row writes its token twice, the same value
    expected = scatter_tokens(base, index, values)
    assert write_tokens(base, index, values) is base
    torch.testing.assert_close(base, expected, atol=0, rtol=0)


def test_padding_with_first_masked_token_is_exact():
    """Row 0 has 3 masked tokens, row 1 one, padded to [t, t, t]: its duplicate queries give
    identical outputs, and the scatter writes the same token as the unpadded row alone would."""
    tokens, hidden, heads = 9, 8, 2
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, tokens, hidden, generator=g)
    cached = torch.randn(2, tokens, hidden, generator=g)
    index = torch.tensor([[2, 5, 6], [4, 4, 4]])

    def heads_of(t):
        return t.view(t.shape[0], t.shape[1], heads, hidden // heads).transpose(1, 2)

    def merged(t):
        return t.transpose(1, 2).reshape(t.shape[0], -1, hidden)

    out = merged(masked_query_attention(heads_of(gather_tokens(x, index)), heads_of(x), heads_of(x)))
    torch.testing.assert_close(out[1, 1:], out[1, :1].expand(2, -1), atol=1e-6, rtol=0)
    alone = merged(masked_query_attention(heads_of(x[1:, [4]]), heads_of(x[1:]), heads_of(x[1:])))
    torch.testing.assert_close(out[1, :1], alone[0], atol=1e-6, rtol=0)

    written = scatter_tokens(cached, index, out)
    untouched = torch.ones(2, tokens, dtype=torch.bool)
    untouched[0, [2, 5, 6]] = untouched[1, 4] = False
    torch.testing.assert_close(written[untouched], cached[untouched], atol=0, rtol=0)
    torch.testing.assert_close(written[1, 4], alone[0, 0], atol=1e-6, rtol=0)
