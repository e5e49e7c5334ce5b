"""RAP's mapping: where each table and its preprocessing live (a MILP), and the mapped co-run's input path."""
from __future__ import annotations

from recforge.exports import lazy_exports

# Names resolve on first use: RAP's modules load torch, the package itself stays cheap.
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.rap.mapping.milp": (
        "MappingCosts", "MappingError", "MappingResult", "Placement", "TableLoad", "candidate_placements", "evaluate",
        "from_torchrec", "rank_plan", "solve", "split_rank_plan",
    ),
    "recforge.rap.mapping.job_mapping": (
        "COMPILE_METHOD", "placements_from_json", "placements_to_json", "plan_mapping", "planner_placements",
    ),
    "recforge.rap.mapping.worker_mapping": (
        "MAPPING_FILE", "MappingFileError", "WorkerMapping", "load_mapping", "mapped_jobs", "placements_for_world",
        "write_mapping",
    ),
    "recforge.rap.mapping.mapped_input": ("MappedInput", "MappedInputError"),
    "recforge.rap.mapping.mapped_batches": ("MappedCorunBatches", "MappedTaskBatches"),
})
