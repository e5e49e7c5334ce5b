"""recforge.rap.planning."""
