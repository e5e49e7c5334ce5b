"""Stand-in for `recforge.worker`, run by tests/unit/test_elastic_local.py under torchrun.

`python -m elastic_stub_worker SPEC_JSON` (tests/unit on PYTHONPATH). It follows the worker's
protocol with the job master without training anything: per step each rank leases a task (until the
master says its epoch is over), the ranks all_reduce "has data" over gloo and stop when no rank has
any; a task's rows are "consumed" and reported done. Rank 0 writes output_dir/result.json with the
all_reduced row count. Spec keys: master_url, output_dir, train.epochs, and for failure tests
`fail` (raise at once with that message), `hang` (never finish) or `crash_rank` (that rank dies hard while holding its
second task, in the first launch generation only); `obey_stop`: after every step rank 0 asks the master
for its command and the group exits 0 on "stop" (a rescale).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("fail"):
        raise RuntimeError(spec["fail"])
    if spec.get("hang"):  # for stop(): mark that this rank runs, then never finish
        out = Path(spec["output_dir"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"running-{os.environ['RANK']}-{os.getpid()}").touch()
        time.sleep(3600)
    import torch  # lazy: after the failure check, so a failing launch stays quick
    import torch.distributed as dist  # lazy: as torch

    from recforge.elastic.agent.client import MasterClient, read_token_file  # lazy: as torch

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    crash = spec.get("crash_rank") == rank and generation == 0
    client = MasterClient(spec["master_url"], worker_id=f"rank{rank}-g{generation}", poll_interval_s=0.05,
                          token=read_token_file(spec["master_token_file"]))
    start = torch.tensor([client.epoch_state()["epoch"]])
    dist.broadcast(start, 0)
    rows, tasks, step = 0, 0, 0
    for epoch in range(int(start.item()), int(spec["train"]["epochs"])):
        client.epoch = epoch
        exhausted = False
        while True:
            task = None if exhausted else client.lease()
            exhausted = task is None
            has = torch.tensor([0 if task is None else 1])
            dist.all_reduce(has)
            if has.item() == 0:
                break
            if task is not None:
                tasks += 1
                if crash and tasks == 2:
                    os._exit(3)  # die holding a lease, as a crashed trainer would
                rows += task.rows
                client.done(task.task_id, task.rows)
            step += 1
            client.heartbeat(step)
            if spec.get("obey_stop"):  # a rescale: every rank holds nothing now; stop cleanly like the worker
                stop = torch.tensor([1 if rank == 0 and client.command()["command"] == "stop" else 0])
                dist.broadcast(stop, 0)
                if stop.item():
                    client.close()
                    dist.destroy_process_group()
                    return
    total = torch.tensor([rows])
    dist.all_reduce(total)
    if rank == 0:
        out = Path(spec["output_dir"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({
            "world_size": world,
            "rows": int(total.item()),
            "generation": generation,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "finished": client.finished or client.epoch_state()["finished"],
        }))
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    from recforge.elastic.backends.local import die_with_launcher

    die_with_launcher()  # as recforge.worker: SIGKILL with torchrun
    main(sys.argv[1])
