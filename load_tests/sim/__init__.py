"""The discrete-event simulator: live policies through the live `RouterCore`, timed by a cost model.

    python -m stepserve.load_tests.sim --workload local-tiny --profile tiny-sd-cpu --workers 2
"""

from .services import TextEncoderSpec
from .simulator import RequestTrace, SimConfig, SimResult, Simulation, simulate

__all__ = ["RequestTrace", "SimConfig", "SimResult", "Simulation", "TextEncoderSpec", "simulate"]
