"""recforge.recom.backend."""
