"""RECom's column IR: each embedding column analyzed into a ColumnProgram, simplified by the passes."""
from recforge.recom.columns.analyze import ColumnAnalyzer, analyze_columns
from recforge.recom.columns.intervals import IntervalSet
from recforge.recom.columns.onehot import prove_one_hot
from recforge.recom.columns.passes import PassLog, ids_range, optimize
from recforge.recom.columns.program import ColumnProgram

__all__ = [
    "ColumnAnalyzer", "ColumnProgram", "IntervalSet", "PassLog", "analyze_columns", "ids_range", "optimize",
    "prove_one_hot",
]
