"""The discrete-event simulator: live policies through the live `RouterCore`, timed by a cost model.

    python -m stepserve.load_tests.sim --workload local-tiny --profile tiny-sd-cpu --workers 2
"""

from stepserve.load_tests.sim.services import TextEncoderSpec
from stepserve.load_tests.sim.simulator import RequestTrace, SimConfig, SimResult, Simulation, simulate

__all__ = ["RequestTrace", "SimConfig", "SimResult", "Simulation", "TextEncoderSpec", "simulate"]
