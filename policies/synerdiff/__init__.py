"""SynerDiff's planning algorithms (synerdiff.txt), as pure policy code.

    §III-C Eq. 1-2        VAE chunking granularity c, C_max, B_max from
                          profiled timings                                  chunking.py
    §III-C                the lookup table T_cost^c(m, n, k) of tau, delta  types.py (ConcurrencyTable)
    §III-B Fig. 9, §III-D skip-CFG window s_min from a quality threshold S  skip_cfg.py
    §III-D Eq. 3, Alg. 1  the sequence of concurrent UNet/VAE rounds (exact
                          3D-DP with Pareto labels) and its task mapping E  sequence_dp.py
    §III-D last paragraph the load feedback controller over S and c         controller.py

Per worker and per planning point, the caller (the executor's local policy or the simulator):
takes S and c from the controller, counts K (tasks whose next step is >= s_min for S), calls
`plan_sequence(M, N, K, table_for_c, alpha)` and `assign` to get each round's tasks. Nothing
here reads files, clocks or devices.
"""

from stepserve.policies.synerdiff.chunking import (
    ChunkTiming,
    choose_chunks,
    chunk_cost,
    max_chunks,
    saturation_batch,
    unet_latency,
    unet_overhead,
    vae_latency,
)
from stepserve.policies.synerdiff.controller import ControllerConfig, ControllerState, chunks, observe, quality, start
from stepserve.policies.synerdiff.sequence_dp import assign, plan_sequence, time_limit
from stepserve.policies.synerdiff.skip_cfg import SkipCfgCurve
from stepserve.policies.synerdiff.types import ConcurrencyTable, Round, SequencePlan

__all__ = [
    "ChunkTiming",
    "ConcurrencyTable",
    "ControllerConfig",
    "ControllerState",
    "Round",
    "SequencePlan",
    "SkipCfgCurve",
    "assign",
    "choose_chunks",
    "chunk_cost",
    "chunks",
    "max_chunks",
    "observe",
    "plan_sequence",
    "quality",
    "saturation_batch",
    "start",
    "time_limit",
    "unet_latency",
    "unet_overhead",
    "vae_latency",
]
