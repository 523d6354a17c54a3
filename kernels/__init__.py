"""Compute ops, each with a torch reference: masked-query attention and token gather/scatter for
edits that compute only their masked tokens (`masked_attention`, InstGenIE §3.1); attention per
sequence over sequences packed along one axis, for mixed-resolution batches (`varlen_attention`,
PatchedServe §4)."""
