"""recforge.elastic.backends."""
