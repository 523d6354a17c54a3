"""InstGenIE's mask-aware editing costs and placement (instgenie.txt), as pure policy code.

    §3.2 Table 1, §4.4 Fig. 11   FLOPs and cached bytes of a batch of edits by mask ratio, the
                                 fitted latency lines, per-block costs       edit_costs.py
    §4.2 Algorithm 1, Fig. 9     which blocks load their cached activations (and the naive,
                                 always-load, exact and ideal ways to compare) pipeline_dp.py
    §4.2 Algorithm 1             its measured per-block costs by shape, for the
                                 workers' DP (`stepserve profile`)            block_profile.py
    §4.3                         step-level continuous batching                policies/continuous.py
    §4.4 Algorithm 2             mask-aware placement, policy "mask_aware"    placement.py
    §4.4 Fig. 11                 the FLOPs line fitted to a profile's masked
                                 forwards (`stepserve profile`)               edit_profile.py

`MaskAwareCosts(base, {model: EditCostModel})` is the `CostModel` the simulator and the policy
share: forwards that reuse cached activations (`BatchShape.mask_ratio` < 1) cost what the edit
model says, everything else what `base` (a profile) says; `profiled_costs` builds it from a
profile with masked rows.
"""

from stepserve.policies.instgenie.edit_costs import (
    BlockCosts,
    DiTDims,
    EditCostModel,
    LinearFit,
    MaskAwareCosts,
    fit_line,
    forward_flops,
)
from stepserve.policies.instgenie.edit_profile import fitted_edit_models, profiled_costs
from stepserve.policies.instgenie.pipeline_dp import Loading, Pipeline, algorithm1, optimal, pipeline_latency, plan
from stepserve.policies.instgenie.placement import Horizon, MaskAwareConfig, MaskAwarePlacement

__all__ = [
    "BlockCosts",
    "DiTDims",
    "EditCostModel",
    "Horizon",
    "LinearFit",
    "Loading",
    "MaskAwareConfig",
    "MaskAwareCosts",
    "MaskAwarePlacement",
    "Pipeline",
    "algorithm1",
    "fit_line",
    "fitted_edit_models",
    "forward_flops",
    "optimal",
    "pipeline_latency",
    "plan",
    "profiled_costs",
]
