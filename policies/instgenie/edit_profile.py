"""Edit pricing fitted to a profile's masked rows (InstGenIE §4.4, Fig. 11, on this device's numbers).

`stepserve profile` measures, for a model that edits with cached activations, the forward the
workers serve for such edits (the masked tokens computed, the rest from a template's record,
loads included) at a few mask ratios and batch shapes: its denoise rows with mask_ratio < 1. As
the paper, a line maps each forward's FLOPs (Table 1, counted from the model's `DiTDims`) to its
latency, fitted by least squares. The loads are inside those seconds, so the fitted
`EditCostModel` loads for free and every block uses its cache, as the workers run it; full
forwards stay the profile's own fit.

What the router and the simulator ask: `profiled_costs(profile, dims)` is the profile itself where
no model has masked rows (every forward priced in full, as before), else a `MaskAwareCosts` that
prices the forwards with cached activations of the models in `dims` from their line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from stepserve.policies.cost_model import DENOISE, BatchShape, CostModel, ProfiledCostModel, ProfileError, ProfileRow
from stepserve.policies.instgenie.edit_costs import DiTDims, EditCostModel, LinearFit, MaskAwareCosts
from stepserve.policies.instgenie.pipeline_dp import Loading

LOADS_MEASURED = LinearFit(0.0, 0.0)  # the loads are inside the measured forwards: none on top


def fitted_edit_models(rows: Iterable[ProfileRow], dims: Mapping[str, Sequence[DiTDims]]) -> dict[str, EditCostModel]:
    """Per model of `dims` with masked rows among `rows`: its FLOPs-to-latency line over them.
    Raises `ProfileError` where a model's masked rows cannot make a line (one FLOPs count only)."""
    samples: dict[str, list[tuple[BatchShape, float]]] = {}
    for row in rows:
        if row.component == DENOISE and row.mask_ratio < 1.0 and row.model in dims:
            batch = BatchShape(row.model, row.height, row.width, row.rows, mask_ratio=row.mask_ratio)
            samples.setdefault(row.model, []).append((batch, row.seconds))
    models = {}
    for model, points in samples.items():
        try:
            models[model] = EditCostModel.fitted(dims[model], points, LOADS_MEASURED, Loading.ALWAYS_LOAD)
        except ValueError as exc:
            raise ProfileError(f"model {model!r}: its masked forwards make no line: {exc}") from None
    return models


def profiled_costs(profile: ProfiledCostModel, dims: Mapping[str, Sequence[DiTDims]]) -> CostModel:
    """`profile`, with the forwards that reuse cached activations of the models in `dims` priced
    from its masked rows (`MaskAwareCosts`); `profile` itself where none of them has any."""
    edits = fitted_edit_models(profile.masked_rows, dims)
    return MaskAwareCosts(profile, edits) if edits else profile
