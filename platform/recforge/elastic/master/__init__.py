"""recforge.elastic.master.service."""
