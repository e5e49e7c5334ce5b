"""recforge.rap.profiling."""
