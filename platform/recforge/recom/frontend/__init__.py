"""recforge.recom.frontend."""
