"""Plans: HF load plans, HF save plans under a SavePolicy, writer assignment, the unshard scheduler, and a whole
save planned at once (``plan_save``, cached)."""

from workbench.plan.load_plan import HFLoadPlan, KeyRead, plan_hf_load
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import HFSavePlan, SaveShardStep, plan_hf_save
from workbench.plan.save_set import SavePlanSet, clear_plan_cache, plan_cache_info, plan_save
from workbench.plan.schedule import GatherCall, GatherItem, UnshardSchedule, check_schedules, schedule_unshard
from workbench.plan.writers import assign_writers

__all__ = [
    "GatherCall",
    "GatherItem",
    "HFLoadPlan",
    "HFSavePlan",
    "KeyRead",
    "SavePlanSet",
    "SavePolicy",
    "SaveShardStep",
    "UnshardSchedule",
    "assign_writers",
    "check_schedules",
    "clear_plan_cache",
    "plan_cache_info",
    "plan_hf_load",
    "plan_hf_save",
    "plan_save",
    "schedule_unshard",
]
