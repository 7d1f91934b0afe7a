"""Test and benchmark helpers: multi-rank launcher, private MPS daemon, dense MoE oracle."""

from .launcher import LaunchPlan, RankContext, TeardownError, plan_launch, run_ranks

__all__ = ["LaunchPlan", "RankContext", "TeardownError", "plan_launch", "run_ranks"]
