"""What the plan stage logs about the preprocessing it plans (MLflow params + one JSON artifact): executor, plan and
the compiler's fused groups, all marked as planned. What the workers executed (one single pass, a call per group,
the torch fallback, DALI) is logged by the train stage (`preprocess_executor_path`, `native_kernels`)."""
from __future__ import annotations

import logging
from typing import Any

from recforge.config import DatasetConfig
from recforge.preprocess.planning.compiler import compile_plan
from recforge.preprocess.planning.plan import Plan

log = logging.getLogger(__name__)
MAX_PARAM = 5000  # MLflow caps a param value at 6000 characters


def preprocess_params(plan: Plan, dataset: DatasetConfig, executor: str, plan_source: str) -> tuple[dict, dict]:
    """(flat MLflow params, full summary for an artifact). The fused groups come from compiling the plan as the
    workers will: they are the plan, not a record of calls (on CPU the fused executor runs a plan whose features
    keep one value per row as one single pass); with the dali executor the ops DALI cannot express are listed
    (they run on fused)."""
    compiled = compile_plan(plan)
    summary: dict[str, Any] = {"executor": executor, "plan_source": plan_source, "planned": True,
                               "executed": "see the train run: preprocess_executor_path", **compiled.summary()}
    groups = ", ".join(g.name for g in compiled.groups)
    params = {
        "preprocess_executor": executor,
        "preprocess_plan": plan_source,
        "preprocess_plan_name": plan.name,
        "preprocess_features": f"{len(plan.dense_features())} dense, {len(plan.sparse_features())} sparse",
        "preprocess_planned_groups": len(compiled.groups),
        "preprocess_planned_group_names": groups if len(groups) <= MAX_PARAM else groups[:MAX_PARAM - 3] + "...",
        "preprocess_compiler": f"{compiled.method} ({compiled.solver_status}, objective {compiled.objective})",
    }
    if executor == "dali":
        # the dali executor's module loads torch and torchrec (seconds); the plan stage and the CLI import this one
        from recforge.preprocess.executors.dali import fallback_summary  # lazy: torch, torchrec (above)

        fb = fallback_summary(compiled, dataset)
        summary["dali"] = fb
        params["preprocess_dali_fallback_ops"] = fb["fallback_ops"]
        params["preprocess_dali_fallback"] = str(fb["fallback_by_op"])[:MAX_PARAM]
        if fb["fallback_ops"]:
            log.warning("dali executor: %d ops of plan %s run on the fused executor: %s", fb["fallback_ops"],
                        plan.name, fb["fallback_reasons"])
    log.info("preprocessing: executor %s, plan %s (%s), %d fused groups planned", executor, plan.name, plan_source,
             len(compiled.groups))
    return params, summary
