"""recforge.rap.mapping.milp."""
