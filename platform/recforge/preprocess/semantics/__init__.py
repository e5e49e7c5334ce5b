"""recforge.preprocess.semantics."""
