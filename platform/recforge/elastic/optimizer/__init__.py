"""DLRover-RM's three-stage resource optimizer: warm start, runtime scaling, instability handling."""
from recforge.elastic.optimizer.errors import MODEL_ERRORS, RECORD_ERRORS
from recforge.elastic.optimizer.events import STAGES, Event, read_jsonl, to_jsonl, write_jsonl
from recforge.elastic.optimizer.instability_stage import InstabilityStage
from recforge.elastic.optimizer.models.history import History, InMemoryHistory, JobRecord
from recforge.elastic.optimizer.models.memory_model import (
    DEFAULT_MEMORY_MODEL,
    GiB,
    MemoryModel,
    MemorySample,
    MemoryTrend,
    embedding_bytes_per_rank,
    embedding_shard_bytes,
    fit_or_prior,
    leave_one_run_out,
    local_default_memory,
    next_memory,
    samples_from_dicts,
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
from recforge.elastic.optimizer.warm_start import (
    WarmStart,
    choose_memory,
    history_memory_points,
    history_points,
    local_default_model,
    local_default_model_problem,
    warm_start,
)

# resource_store (MLflow history and models) is imported by name: it loads recforge.tracking and MLflow.
__all__ = [
    "Allocation", "DEFAULT_MEMORY_MODEL", "DLRoverPolicy", "Event", "GiB", "History", "InMemoryHistory",
    "InstabilityStage", "JobDescription", "JobLimits", "JobRecord", "MODEL_ERRORS", "MemoryModel", "MemorySample",
    "MemoryTrend", "ModelFitError", "Move", "Observation", "OnlineThroughputModel", "OptimizerConfig", "PS_TERMS",
    "PodPlan", "RECORD_ERRORS", "ResourceLimitError", "RuntimeStage", "STAGES", "Sample", "ThroughputModel",
    "WarmStart", "best_moves", "choose_memory", "clamp", "embedding_bytes_per_rank", "embedding_shard_bytes", "fit",
    "fit_or_prior", "fit_profile", "history_memory_points", "history_points", "leave_one_run_out", "load_profile",
    "local_default_memory", "local_default_model", "local_default_model_problem", "next_memory", "optimizer_config",
    "read_jsonl", "samples_from_dicts", "search", "to_jsonl", "warm_start", "write_jsonl"
]
