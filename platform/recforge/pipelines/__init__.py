"""The daily pipeline as plain Python the DAGs call, testable without Airflow.

stages/ holds the seven stages, hooks/ their calls into RAP and DLRover-RM; each stage takes a RunContext, reads
earlier stages' typed outputs (outputs.py) and commits its own atomically under one MLflow child run (stage.py).
runner.py runs them all in one process. Importing this package stays cheap: DAG parsing imports it.
"""
from recforge.exports import lazy_exports

# Names resolve on first use: the stage modules load torch, the DAG-parse path must not.
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.pipelines.context": ("EXPERIMENT", "RunContext", "StageWriter", "run_key_from"),
    "recforge.pipelines.outputs": (
        "CompileOutputs", "EvaluateOutputs", "GenerateOutputs", "IngestOutputs", "OutputsError", "PlanOutputs",
        "PublishOutputs", "STAGE_OUTPUTS", "StageOutputs", "TrainOutputs",
    ),
    "recforge.pipelines.stage": ("run_stage",),
    "recforge.pipelines.runner": ("STAGES", "STAGE_FUNCTIONS", "run_all"),
    "recforge.pipelines.summary": ("summarize",),
})
