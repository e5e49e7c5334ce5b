"""RAP co-running (ASPLOS '24; ../shared/papers/RAP.md): run fused preprocessing of batch i+1 in the spare
capacity of training batch i on the same workers.

Planning (this package's planning half):
  stages.py      STAGES and StageTracker: the five stage boundaries of a training step from module / autograd hooks
  schedule.py    CorunSchedule / Assignment: which fused kernel (or part) runs in which stage; validation; the
                 executable parts the fused executor runs
  profiler.py    stage durations and spare capacity (growing a proxy fused kernel), keyed profiles, MLflow
  cost_model.py  fused-kernel latency vs op, fusion degree, rows, width; cost_probe.py measures our fused executor
  mapping.py     table placement + preprocessing placement MILP (scipy.optimize.milp), per-rank plans
  scheduler.py   RAP's greedy co-run scheduler with kernel splitting
  gantt.py       the schedule as a Gantt PNG
  simulator.py   predicted iteration time of RAP, its ablations and baselines
Runtime (in-trainer execution, the pipeline switch, `recforge bench rap`) builds on stages.py and schedule.py.
Pipeline: corun_pipeline.py (plan / worker / MLflow), profile_job.py (profiles a job with no stored profile).
"""
