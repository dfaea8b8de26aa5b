"""`shardlm plan`: memory math and the parallelism recommendation, from config.json alone."""

from shardlm.planner.model_shape import ModelShape, load_config, load_presets
from shardlm.planner.plan import Hardware, Recommendation, SplitPlan, Workload, evaluate, recommend

__all__ = ["ModelShape", "load_config", "load_presets", "Hardware", "Workload", "SplitPlan", "Recommendation",
           "evaluate", "recommend"]
