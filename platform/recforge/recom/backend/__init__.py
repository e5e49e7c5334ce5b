"""RECom's back end: column programs lowered to the fused embedding kernel, the dense rest exported on its own."""
from recforge.recom.backend.column_compiler import ColumnCompilation, compile_columns
from recforge.recom.backend.dense import build_residual, export_residual, with_onednn
from recforge.recom.backend.embedding_plan import EmbeddingPlan, NotLowerable, build_plan, check_lowerable
from recforge.recom.backend.layer import FusedEmbeddingLayer

__all__ = [
    "ColumnCompilation", "EmbeddingPlan", "FusedEmbeddingLayer", "NotLowerable", "build_plan", "build_residual",
    "check_lowerable", "compile_columns", "export_residual", "with_onednn",
]
