"""recforge.preprocess.planning."""
