"""recforge.recom.columns."""
