"""recforge.elastic.optimizer.dlrover."""
