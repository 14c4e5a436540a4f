"""Plans: HF load plans, HF save plans under a SavePolicy, writer assignment, and the unshard scheduler."""

from workbench.plan.load_plan import HFLoadPlan, KeyRead, plan_hf_load
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import HFSavePlan, SaveShardStep, plan_hf_save
from workbench.plan.schedule import GatherCall, GatherItem, UnshardSchedule, check_schedules, schedule_unshard
from workbench.plan.writers import assign_writers

__all__ = [
    "GatherCall",
    "GatherItem",
    "HFLoadPlan",
    "HFSavePlan",
    "KeyRead",
    "SavePolicy",
    "SaveShardStep",
    "UnshardSchedule",
    "assign_writers",
    "check_schedules",
    "plan_hf_load",
    "plan_hf_save",
    "schedule_unshard",
]
