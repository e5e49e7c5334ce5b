"""RECom's front end: capture a model with torch.export, find its embedding columns, reason about shapes."""
from recforge.recom.frontend.capture import Capture, CaptureError, capture, infer_batch_size
from recforge.recom.frontend.graph_stats import count_lookups, dispatched_ops, graph_ops
from recforge.recom.frontend.identify import Column, ColumnSet, identify_columns
from recforge.recom.frontend.symshape import SymbolicShapes

__all__ = [
    "Capture", "CaptureError", "Column", "ColumnSet", "SymbolicShapes", "capture", "count_lookups",
    "dispatched_ops", "graph_ops", "identify_columns", "infer_batch_size",
]
