"""recforge.worker."""
