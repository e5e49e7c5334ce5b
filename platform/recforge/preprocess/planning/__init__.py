"""Preprocessing plans (plan), their op DAG (graph) and RAP's fused-group compiler (compiler; milp for layers)."""
from recforge.preprocess.planning.compiler import CompiledPlan, FusedGroup, compile_plan
from recforge.preprocess.planning.graph import Node, OpGraph, build_graph
from recforge.preprocess.planning.plan import FeaturePlan, OpSpec, Plan, PlanError, criteo_plan

__all__ = [
    "CompiledPlan", "FeaturePlan", "FusedGroup", "Node", "OpGraph", "OpSpec", "Plan", "PlanError", "build_graph",
    "compile_plan", "criteo_plan",
]
