"""The op vocabulary: the registry here (torch-free, planning reads it); ops, reference, steps as submodules."""
from recforge.preprocess.semantics.registry import OPS, OpDef, OpError, Value, parse_params

__all__ = ["OPS", "OpDef", "OpError", "Value", "parse_params"]
