"""The training process of one rank (`python -m recforge.worker SPEC_JSON`): train + RAP co-run + elastic client."""
from __future__ import annotations

from recforge.exports import lazy_exports

# Names resolve on first use: the trainer loads torchrec, after main() has set up logging.
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.worker.trainer": ("PROBE_FILE", "rank_step_rows", "run"),
    "recforge.train.result": ("RESULT_FILE",),  # rank 0's output_dir holds RESULT_FILE (WorkerResult) and PROBE_FILE
    "recforge.worker.corun": ("epoch_source", "start_session", "worker_mapping"),
    "recforge.worker.elastic_client": ("launch_generation",),
})
