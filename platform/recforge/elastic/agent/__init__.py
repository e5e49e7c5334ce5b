"""recforge.elastic.agent."""
