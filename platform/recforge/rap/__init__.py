"""RAP co-running (stage profiler, cost model, GPU mapping, co-run schedule, runtime).

Not built yet: the foundation preprocesses each batch inside the training worker with
`recforge.preprocess.TorchExecutor` before the step (see DESIGN.md, issue "RAP co-running").
"""
