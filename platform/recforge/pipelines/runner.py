"""Run a whole pipeline in one process: the CLI's and the tests' path without Airflow."""
from __future__ import annotations

from recforge.pipelines.context import RunContext
from recforge.pipelines.outputs import STAGE_OUTPUTS, StageOutputs
from recforge.pipelines.stages.data import generate, ingest
from recforge.pipelines.stages.evaluate import evaluate
from recforge.pipelines.stages.plan import plan_resources
from recforge.pipelines.stages.serve import compile_model, publish
from recforge.pipelines.stages.train import train

STAGES = list(STAGE_OUTPUTS)  # generate, ingest, plan_resources, train, evaluate, compile, publish
STAGE_FUNCTIONS = {
    "generate": generate, "ingest": ingest, "plan_resources": plan_resources, "train": train,
    "evaluate": evaluate, "compile": compile_model, "publish": publish,
}


def run_all(ctx: RunContext) -> dict[str, StageOutputs]:
    """Run every stage in order in this process (the CLI's and the tests' path without Airflow)."""
    return {name: STAGE_FUNCTIONS[name](ctx) for name in STAGES}
