"""recforge.rap.runtime.corun_runtime."""
