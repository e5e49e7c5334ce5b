"""Recovery time after a worker is killed, and the throughput cost of dynamic data sharding.

1. Recovery (run_training_job, 2 ranks x 1 thread, local backend): SIGKILL rank 1 mid-epoch, then
   time, from the master's view (state file polled every 20 ms):
     detect+relaunch+start   kill -> a worker of the new generation joins the master
     first task              join -> the new group loaded the checkpoint, rolled the master back and
                             reported its first task done (training resumed)
   for flash checkpoints (restart loads from shared memory) and disk checkpoints, --repeats each, medians.
2. Sharding (2 ranks x 1 thread, mp.spawn, same model and data): the training loop fed by the job master
   over HTTP (dynamic: leases, done reports, heartbeats) against each rank reading a fixed partition of
   the same tasks with no master at all (static). Interleaved epochs, median samples/s and the overhead.

    python bench/bench_recovery.py --rows 40000 --repeats 3
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform as py_platform  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402

from recforge.elastic.backends.local import free_port  # noqa: E402
from recforge.elastic.master.state_log import read_master_state  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 256


def prepare(root: Path, rows: int):
    from recforge.config import ModelConfig, TrainConfig, dataset_preset
    from recforge.data.generator import generate_days
    from recforge.data.ingest import ingest
    from recforge.preprocess.planning.plan import criteo_plan

    ds = dataset_preset("criteo_kaggle")
    generate_days(ds, root / "raw", days=1, rows_per_day=rows, seed=3)
    ingest([root / "raw" / "day_0.tsv"], ds, root / "train", rows_per_shard=max(rows // 4, 1), max_bad_fraction=0.01)
    plan = criteo_plan(ds, 20_000)
    plan.save(root / "plan.json")
    model = ModelConfig(embedding_dim=16, dense_arch=[64, 16], over_arch=[64, 32, 1])
    train = TrainConfig(epochs=1, batch_size=BATCH, batches_per_task=8, log_every=10, lease_timeout_s=600.0)
    return {"root": root, "ds": ds, "plan": plan, "model": model, "train": train}


# ---- 1. recovery ---------------------------------------------------------------------------
def _poll(state_file: Path, events: dict, stop: threading.Event, kill_after_done: int) -> None:
    while not stop.is_set():
        try:
            d = read_master_state(state_file)  # snapshot + log: what the master has written so far
        except (OSError, ValueError, RuntimeError):
            time.sleep(0.02)
            continue
        now = time.time()
        workers = d["workers"]
        if "kill" not in events:
            done = sum(1 for r in d["queue"]["records"] if r["state"] == "done")
            victims = [w for w in workers if w.startswith("rank1-")]
            if done >= kill_after_done and victims:
                os.kill(int(victims[-1].split("-")[1]), signal.SIGKILL)
                events["kill"] = now
        else:
            new = {w: s for w, s in workers.items() if s["generation"] >= 1}
            if new and "join" not in events:
                events["join"] = now
            if any(s["tasks_done"] > 0 for s in new.values()) and "first_task" not in events:
                events["first_task"] = now
                return
        time.sleep(0.02)


def recovery_run(data, run: Path, flash: bool) -> dict:
    from recforge.config import ResourceConfig
    from recforge.data.manifest import Manifest
    from recforge.elastic.backends.local import LocalBackend
    from recforge.elastic.job import run_training_job
    from recforge.elastic.policy import StaticPolicy

    spec = {
        "manifest_dir": str(data["root"] / "train"), "plan_path": str(data["root"] / "plan.json"),
        "dataset": data["ds"].model_dump(mode="json"), "model": data["model"].model_dump(mode="json"),
        "train": data["train"].model_dump(mode="json"), "checkpoint_dir": str(run / "ckpt"),
        "output_dir": str(run / "out"), "seed": 0, "recovery": {"checkpoint_every_steps": 20, "flash": flash},
    }
    res = ResourceConfig(policy="static", workers=2, threads_per_worker=1, max_restarts=1)
    events: dict = {}
    stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(run / "job" / "master_state.json", events, stop, 12), daemon=True)
    poller.start()
    t0 = time.time()
    result = run_training_job(spec, [s.rows for s in Manifest.load(data["root"] / "train").shards], resources=res,
                              state_dir=run / "job", policy=StaticPolicy(res, cpu_count=2),
                              backend=LocalBackend(max_restarts=0, log_dir=run / "job", monitor_interval_s=0.2),
                              resume=False, timeout_s=900, poll_s=0.1)
    stop.set()
    poller.join(timeout=5)
    worker = json.loads((run / "out" / "result.json").read_text())
    if not {"kill", "join", "first_task"} <= set(events):
        raise RuntimeError(f"recovery events incomplete: {events}")
    return {
        "flash": flash, "job_wall_s": time.time() - t0, "restarts": result.restarts,
        "detect_relaunch_start_s": events["join"] - events["kill"],
        "first_task_s": events["first_task"] - events["join"],
        "kill_to_resumed_s": events["first_task"] - events["kill"],
        "resumed_from": worker["resumed_from"]["source"] if worker["resumed_from"] else None,
        "resumed_step": worker["resumed_from"]["step"] if worker["resumed_from"] else None,
    }


# ---- 2. dynamic vs static sharding ----------------------------------------------------------
class StaticClient:
    """A fixed list of tasks for one rank, no master: what static sharding amounts to."""

    def __init__(self, tasks):
        self.tasks = list(tasks)

    def lease(self):
        return self.tasks.pop(0) if self.tasks else None

    def done(self, task_id, samples):
        return True

    def heartbeat(self, step):
        return 0


def _sharding_worker(rank: int, port: int, master_urls: list[str], data_root: str, epochs: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from recforge.config import ModelConfig, TrainConfig, dataset_preset
    from recforge.data.manifest import Manifest
    from recforge.elastic.agent.client import MasterClient
    from recforge.elastic.master.tasks import TaskQueue
    from recforge.preprocess.executor import TorchExecutor
    from recforge.preprocess.planning.plan import Plan
    from recforge.train.loop.batches import TaskBatches, empty
    from recforge.train.loop.step_loop import Heartbeat, LoopState, train_epoch
    from recforge.train.model import build_dlrm
    from recforge.train.sharding import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    root = Path(data_root)
    ds = dataset_preset("criteo_kaggle")
    plan = Plan.load(root / "plan.json")
    torch.manual_seed(0)
    model = build_dlrm(ModelConfig(embedding_dim=16, dense_arch=[64, 16], over_arch=[64, 32, 1]), plan.tables(),
                       len(plan.dense_features()))
    sm = shard_model(model, TrainConfig(batch_size=BATCH), world_size=2, device=torch.device("cpu"))
    executor = TorchExecutor(plan, ds)
    zero = empty(ds, BATCH, executor, torch.device("cpu"))
    shard_rows = [s.rows for s in Manifest.load(root / "train").shards]
    all_tasks = TaskQueue(shard_rows, BATCH * 8).tasks()
    rates = {"dynamic": [], "static": []}
    for e in range(epochs):
        for mode in ("dynamic", "static") if e % 2 == 0 else ("static", "dynamic"):
            if mode == "dynamic":
                client = MasterClient(master_urls[e], worker_id=f"rank{rank}")  # a fresh master (queue) per epoch
                client.epoch = 0
                hb = Heartbeat(client, interval_s=10.0)
            else:
                client = StaticClient(all_tasks[rank::2])
                hb = None
            source = TaskBatches(client, root / "train", ds, executor, BATCH, torch.device("cpu"))
            dist.barrier()
            t0 = time.perf_counter()
            stats = train_epoch(sm, source, zero, LoopState(), epoch=0, world_size=2, log_every=10**9, heartbeat=hb)
            dist.barrier()
            rates[mode].append(stats.samples / (time.perf_counter() - t0))
    if rank == 0:
        Path(out).write_text(json.dumps(rates))
    dist.destroy_process_group()


def sharding_overhead(data, epochs: int) -> dict:
    import torch.multiprocessing as mp

    from recforge.data.manifest import Manifest
    from recforge.elastic.master.service import JobMaster

    shard_rows = [s.rows for s in Manifest.load(data["root"] / "train").shards]
    token = os.environ.setdefault("RECFORGE_MASTER_TOKEN", secrets.token_urlsafe(32))  # the spawned ranks read it
    masters = [JobMaster(shard_rows, rows_per_task=BATCH * 8, lease_timeout_s=600, token=token).start()
               for _ in range(epochs)]
    out = data["root"] / "sharding.json"
    try:
        mp.spawn(_sharding_worker, args=(free_port(), [m.url for m in masters], str(data["root"]), epochs, str(out)),
                 nprocs=2)
    finally:
        for m in masters:
            m.stop()
    rates = json.loads(out.read_text())
    dyn, sta = statistics.median(rates["dynamic"]), statistics.median(rates["static"])
    return {"dynamic_samples_per_s": dyn, "static_samples_per_s": sta, "overhead": 1 - dyn / sta, "raw": rates}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=40_000)
    p.add_argument("--repeats", type=int, default=3, help="recovery runs per checkpoint kind")
    p.add_argument("--epochs", type=int, default=6, help="sharding comparison epochs per mode")
    p.add_argument("--skip-recovery", action="store_true")
    p.add_argument("--skip-sharding", action="store_true")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="recforge-bench-recovery-"))
    doc: dict = {"bench": "recovery", "rows": args.rows, "world_size": 2, "threads_per_rank": 1,
                 "machine": py_platform.platform(), "cpu_count": os.cpu_count()}
    try:
        data = prepare(tmp, args.rows)
        if not args.skip_recovery:
            runs = []
            for i in range(args.repeats):
                for flash in (True, False):
                    r = recovery_run(data, tmp / f"run-{i}-{'flash' if flash else 'disk'}", flash)
                    print(json.dumps(r))
                    runs.append(r)
            doc["recovery_runs"] = runs
            print(f"{'checkpoint':10s} {'kill->join s':>13s} {'join->first task s':>19s} {'kill->resumed s':>16s}")
            summary = {}
            for kind, flag in (("flash", True), ("disk", False)):
                rs = [r for r in runs if r["flash"] is flag]
                med = {k: statistics.median(r[k] for r in rs) for k in
                       ("detect_relaunch_start_s", "first_task_s", "kill_to_resumed_s")}
                summary[kind] = med
                print(f"{kind:10s} {med['detect_relaunch_start_s']:13.2f} {med['first_task_s']:19.2f} "
                      f"{med['kill_to_resumed_s']:16.2f}")
            doc["recovery_median"] = summary
        if not args.skip_sharding:
            s = sharding_overhead(data, args.epochs)
            doc["sharding"] = s
            print(f"dynamic sharding {s['dynamic_samples_per_s']:.0f} samples/s, "
                  f"static {s['static_samples_per_s']:.0f} samples/s: overhead {100 * s['overhead']:.1f}% (goal <= 5%)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    doc["time"] = stamp
    path = RESULTS / f"bench_recovery_{stamp}.json"
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
