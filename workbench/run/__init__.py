"""Running plans: the unshard executor, communicators, and the in-process SimulatedWorld."""

from workbench.run.communicator import Communicator, drive
from workbench.run.executor import GatherRequest, WaveOutput, unshard
from workbench.run.launcher import LaunchError, RankFailure, launch
from workbench.run.simulated import SavePlanSet, SimulatedWorld, plan_save

__all__ = [
    "Communicator",
    "GatherRequest",
    "LaunchError",
    "RankFailure",
    "SavePlanSet",
    "SimulatedWorld",
    "WaveOutput",
    "drive",
    "launch",
    "plan_save",
    "unshard",
]
