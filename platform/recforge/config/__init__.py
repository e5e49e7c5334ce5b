"""Typed configuration, validated at the edge: dataset schemas (datasets) and pipeline runs (pipeline).

Every model forbids unknown fields, so a typo in a config file is an error that names the field.
"""
from recforge.config.base import StrictModel
from recforge.config.datasets import (
    CRITEO_DENSE_MISSING,
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_SPARSE_MISSING,
    CRITEO_TERABYTE_CARDINALITIES,
    DATASET_PRESETS,
    HASH_HEADROOM,
    ROLES,
    Column,
    DatasetConfig,
    DenseFeature,
    IgnoredColumn,
    LabelColumn,
    MultiHotFeature,
    SparseFeature,
    TimestampColumn,
    criteo_kaggle_dataset,
    criteo_terabyte_dataset,
    dataset_preset,
    load_dataset,
    load_dataset_file,
    rap_plan2_dataset,
    rap_plan3_dataset,
    rap_synthetic_dataset,
    wide_dataset,
)
from recforge.config.pipeline import (
    CorunConfig,
    DLRoverConfig,
    ModelConfig,
    PipelineConfig,
    ResourceConfig,
    TrainConfig,
    load_config,
)

__all__ = [
    "CRITEO_DENSE_MISSING", "CRITEO_KAGGLE_CARDINALITIES", "CRITEO_SPARSE_MISSING", "CRITEO_TERABYTE_CARDINALITIES",
    "DATASET_PRESETS", "HASH_HEADROOM", "ROLES", "Column", "CorunConfig", "IgnoredColumn", "LabelColumn",
    "MultiHotFeature",
    "TimestampColumn", "load_dataset", "load_dataset_file",
    "DLRoverConfig", "DatasetConfig", "DenseFeature", "ModelConfig",
    "PipelineConfig", "ResourceConfig", "SparseFeature", "StrictModel", "TrainConfig", "criteo_kaggle_dataset",
    "criteo_terabyte_dataset", "dataset_preset", "load_config", "rap_plan2_dataset", "rap_plan3_dataset",
    "rap_synthetic_dataset", "wide_dataset",
]
