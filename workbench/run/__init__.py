"""Running plans: the unshard executor, communicators, and the in-process SimulatedWorld."""

from workbench.run.communicator import Communicator, drive
from workbench.run.executor import GatherRequest, WaveOutput, unshard
from workbench.run.simulated import SavePlanSet, SimulatedWorld, plan_save

__all__ = [
    "Communicator",
    "GatherRequest",
    "SavePlanSet",
    "SimulatedWorld",
    "WaveOutput",
    "drive",
    "plan_save",
    "unshard",
]
