"""DLRover-RM's three-stage resource optimizer: warm start, runtime scaling, instability handling."""
from recforge.elastic.optimizer.events import STAGES, Event, read_jsonl, to_jsonl, write_jsonl
from recforge.elastic.optimizer.instability_stage import InstabilityStage
from recforge.elastic.optimizer.models.history import History, InMemoryHistory, JobRecord
from recforge.elastic.optimizer.models.memory_model import (
    DEFAULT_MEMORY_MODEL,
    GiB,
    MemoryModel,
    MemorySample,
    MemoryTrend,
    embedding_shard_bytes,
    next_memory,
)
from recforge.elastic.optimizer.models.throughput_model import (
    PS_TERMS,
    Allocation,
    ModelFitError,
    OnlineThroughputModel,
    Sample,
    ThroughputModel,
    fit,
    fit_profile,
    load_profile,
)
from recforge.elastic.optimizer.observation import Observation
from recforge.elastic.optimizer.plans import (
    JobDescription,
    JobLimits,
    OptimizerConfig,
    PodPlan,
    ResourceLimitError,
    optimizer_config,
)
from recforge.elastic.optimizer.policy import DLRoverPolicy
from recforge.elastic.optimizer.runtime_stage import RuntimeStage
from recforge.elastic.optimizer.search import Move, best_moves, clamp, search
from recforge.elastic.optimizer.warm_start import WarmStart, history_points, local_default_model, warm_start

# resource_store (MLflow history and models) is imported by name: it loads recforge.tracking and MLflow.
__all__ = [
    "DEFAULT_MEMORY_MODEL", "PS_TERMS", "STAGES", "Allocation", "DLRoverPolicy", "Event", "GiB", "History",
    "InMemoryHistory", "InstabilityStage", "JobDescription", "JobLimits", "JobRecord", "MemoryModel", "MemorySample",
    "MemoryTrend", "ModelFitError", "Move", "Observation", "OnlineThroughputModel", "OptimizerConfig", "PodPlan",
    "ResourceLimitError", "RuntimeStage", "Sample", "ThroughputModel", "WarmStart", "best_moves", "clamp",
    "embedding_shard_bytes", "fit", "fit_profile", "history_points", "load_profile", "local_default_model",
    "next_memory", "optimizer_config", "read_jsonl", "search", "to_jsonl", "warm_start", "write_jsonl",
]
