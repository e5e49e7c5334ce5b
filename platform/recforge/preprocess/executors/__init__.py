"""Executors behind the preprocess.executor.Executor seam: eager (one torch op per feature per op), fused (one
custom-op launch per fused group of the compiled plan) and dali (an NVIDIA DALI pipeline, falling back to fused
for what DALI cannot express). Build them with recforge.preprocess.executor.make_executor."""
