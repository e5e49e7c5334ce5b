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
  mapping_plan.py  a job's placements for the pipeline: costs from the stage profile and timed kernels, the MILP,
                 TorchRec's planner placement as "before"
Runtime:
  runtime.py     CorunRuntime: a schedule's kernels (one job, or RAP's two: global / local rows) gated by the stages
  corun_batches.py, corun_session.py   the trainer's batch source reading ahead, the worker's session
  mapped_input.py  the sharded EBC takes ids already on their table's owner: no input all-to-all
  mapped_batches.py  global batches; each rank preprocesses its tables over them and the rest over its rows
Pipeline: corun_pipeline.py (plan / worker / MLflow), corun_mapping.py (the mapping file: placements and each
rank's jobs), profile_job.py + profile_ranks.py (profiles a job with no stored profile, on its world size),
corun_offline.py (the offline baseline). Benchmarks: bench/bench_rap.py, bench_rap_mapping.py, bench_rap_planning.py.
"""
