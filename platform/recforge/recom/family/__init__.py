"""Massive-column inference models (RECom's E/F family): columns, model builder, request batches."""
from recforge.recom.family.data import batch_of, fingerprint_strings, make_features, select_rows
from recforge.recom.family.model import (
    PRESETS,
    ColumnModel,
    EmbeddingLayer,
    FamilySpec,
    build_model,
    preset,
    scaled,
)

__all__ = [
    "PRESETS", "ColumnModel", "EmbeddingLayer", "FamilySpec", "batch_of", "build_model", "fingerprint_strings",
    "make_features", "preset", "scaled", "select_rows",
]
