"""PatchedServe's SLO-aware scheduling (patchedserve.txt §6) and its mixed-resolution pricing, as
pure policy code. scheduler.py maps the paper's stages to the files:

    slack.py           the slack score and Algorithm 1's time-out
    mixed_costs.py     what one forward of several resolutions costs (`PackedForwardCosts`)
    packed_profile.py  that price checked and calibrated against a profile's packed forwards
    samples.py         the Throughput Analyzer's dataset: measured batches, the cost model filling in
    predictor.py       the Throughput Analyzer (an MLP) and its held-out error
    latency.py         a batch's predicted step latency: the analyzer, else the cost model
    schedulability.py  predicted finishes of a worker's batch; who a candidate would make late
    scheduler.py       Algorithm 1 as the policy "patchedserve"
    types.py           its config
"""

from stepserve.policies.patchedserve.latency import BatchLatency
from stepserve.policies.patchedserve.mixed_costs import PackedForwardCosts, PackingFit, packed
from stepserve.policies.patchedserve.packed_profile import PackingReport, packing_fits, packing_report
from stepserve.policies.patchedserve.predictor import HoldoutReport, ThroughputAnalyzer, holdout_error
from stepserve.policies.patchedserve.samples import (LatencySample, measured_samples, random_compositions,
                                                     training_samples)
from stepserve.policies.patchedserve.scheduler import PatchedServePolicy, decide_round
from stepserve.policies.patchedserve.slack import request_slack, slack_score, time_out
from stepserve.policies.patchedserve.types import PatchedServeConfig, Predictor

__all__ = [
    "BatchLatency",
    "HoldoutReport",
    "LatencySample",
    "PackedForwardCosts",
    "PackingFit",
    "PackingReport",
    "PatchedServeConfig",
    "PatchedServePolicy",
    "Predictor",
    "ThroughputAnalyzer",
    "decide_round",
    "holdout_error",
    "measured_samples",
    "packed",
    "packing_fits",
    "packing_report",
    "random_compositions",
    "request_slack",
    "slack_score",
    "time_out",
    "training_samples",
]
