"""Run by test_task_executor in a fresh interpreter: preload the task stack, start recforge's executor (its worker
forks from this process and preloads), stop it, then fork a child that uses torch's thread pool, pyarrow and TorchRec
as a task would. Prints one JSON line: the modules loaded, the preload failures, the child's exit status."""
from __future__ import annotations

import json
import logging
import os
import sys
import tempfile


def _task_like_child(parquet: str) -> None:
    import pyarrow.parquet as pq
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    torch.set_num_threads(2)
    x = torch.randn(512, 512)
    assert torch.isfinite(x @ x).all()
    assert pq.read_table(parquet, use_threads=True).num_rows == 1000
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
                                                            feature_names=["f"])])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    assert ebc(kjt).values().shape == (2, 4)


def main() -> None:
    from recforge.pipelines.task_executor import PreloadingLocalExecutor, preload

    # after Airflow's import, which configures logging its own way
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s", force=True)
    failed = preload()
    executor = PreloadingLocalExecutor(parallelism=1)
    executor.start()
    executor.end()  # the poison pill: the worker preloads, then takes it and exits

    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = os.path.join(tempfile.mkdtemp(), "rows.parquet")
    pq.write_table(pa.table({"a": list(range(1000))}), parquet)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _task_like_child(parquet)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"modules": sorted(sys.modules), "failed": failed, "child_status": status,
                      "parent_pid": os.getpid()}))


if __name__ == "__main__":
    main()
