"""RAP's runtime in a worker: a schedule's kernels gated by the training stages, and the batches they feed."""
from __future__ import annotations

from recforge.exports import lazy_exports

# Names resolve on first use: RAP's modules load torch, the package itself stays cheap.
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.rap.runtime.corun_runtime": ("CorunConfigError", "CorunJob", "CorunRuntime"),
    "recforge.rap.runtime.corun_batches": ("CorunBatch", "CorunTaskBatches"),
    "recforge.rap.runtime.session": ("CorunSession",),
    "recforge.rap.runtime.offline": ("OfflineError", "OfflineTaskBatches", "preprocess_manifest"),
})
