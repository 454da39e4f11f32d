"""Pre-flight checks of a PPO configuration (`python -m lightrft.cli.doctor`, docs/doctor.md).

Each check is a function of a built run returning a `CheckResult`; `lightrft.cli.doctor` builds the
run from train_ppo's flags, runs the checks on every rank and prints the report on rank 0."""

from lightrft.doctor.data import check_data
from lightrft.doctor.engine import check_engine
from lightrft.doctor.invariance import check_invariance
from lightrft.doctor.memory import MemoryProbe, check_memory
from lightrft.doctor.moe import check_moe
from lightrft.doctor.monitors import check_monitors
from lightrft.doctor.report import CheckResult, DoctorReport, Finding, format_table, percentile
from lightrft.doctor.rewards import check_rewards
from lightrft.doctor.workflow import check_workflow

CHECKS = ("data", "monitors", "memory", "invariance", "engine", "moe", "rewards", "workflow")

__all__ = ["CHECKS", "CheckResult", "DoctorReport", "Finding", "MemoryProbe", "check_data", "check_engine",
           "check_invariance", "check_memory", "check_moe", "check_monitors", "check_rewards", "check_workflow",
           "format_table", "percentile"]
