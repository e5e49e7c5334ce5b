"""recforge.train.recovery."""
