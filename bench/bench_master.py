"""Job master under load: N simulated workers (asyncio httpx clients on loopback) against a real JobMaster.

Each worker joins, heartbeats every `--heartbeat-s` (1 s) and leases a task, "trains" it for a uniform
[task_s/2, 3*task_s/2] seconds and reports it done, until the master says the job is finished. The queue is sized
so that the run takes about `--duration` seconds. The clients run in `--client-procs` subprocesses (the master
keeps its own process: its uvicorn thread and the compactor), each keeping a ledger of the tasks the master
accepted as done. Reported per N: p50 / p99 / max request latency per endpoint as the clients saw it (and the time
spent inside the master per endpoint), requests/s, tasks/s, the master's CPU time per request, and the ledger
proof: every row of the job done exactly once, nothing lost, nothing twice, and the persisted state (snapshot +
log) equal to the master's memory.

    recforge bench master [--workers 16,128,1024] [--duration 30] [--client-procs 2]
Results: bench/results/master.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_report  # noqa: E402

ROWS_PER_TASK = 100
SHARDS = 16
ENDPOINTS = ("join", "lease", "heartbeat", "done")


# ---- client side (a subprocess) ---------------------------------------------------------------
class _Conn:
    """A minimal HTTP/1.1 keep-alive client over asyncio streams: one connection per simulated worker, one
    request at a time (like a worker's MasterClient). Far cheaper per request than httpx.AsyncClient, whose
    CPU cost on this machine was several times the master's (see docs/fault_tolerance.md)."""

    def __init__(self, url: str, token: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.addr = (host, int(port))
        self.auth = f"Authorization: Bearer {token}\r\n"
        self.lock = asyncio.Lock()
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: master\r\n{self.auth}Content-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        async with self.lock:
            if self.streams is None:
                self.streams = await asyncio.open_connection(*self.addr)
            reader, writer = self.streams
            try:
                writer.write(head + data)
                raw = await reader.readuntil(b"\r\n\r\n")
                lines = raw.decode("latin-1").split("\r\n")
                status = int(lines[0].split()[1])
                length = next(int(x.split(":", 1)[1]) for x in lines[1:] if x.lower().startswith("content-length"))
                payload = await reader.readexactly(length)
            except BaseException:
                writer.close()
                self.streams = None
                raise
        return status, json.loads(payload)


class _HttpxConn:
    """The same calls through httpx.AsyncClient (`--http httpx`), for comparison."""

    def __init__(self, http: Any) -> None:
        self.http = http

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        r = await self.http.post(path, json=body)
        return r.status_code, r.json()


async def _worker(conn: Any, wid: str, args: argparse.Namespace, lat: dict[str, list[float]],
                  ledger: list[list[Any]], errors: Counter, t0: float, stop: asyncio.Event) -> None:
    rng = random.Random(wid)

    async def call(name: str, body: dict[str, Any]) -> dict[str, Any] | None:
        start = time.perf_counter()
        try:
            status, doc = await conn.post(f"/{name}", body)
        except Exception as e:  # noqa: BLE001 - counted and reported, the run goes on
            errors[f"{name}: {type(e).__name__}"] += 1
            return None
        if start - t0 >= args.warmup_s:
            lat[name].append((time.perf_counter() - start) * 1000.0)
        if status != 200:
            errors[f"{name}: HTTP {status}"] += 1
            return None
        return doc

    await asyncio.sleep(rng.random() * args.heartbeat_s)  # workers start spread over one heartbeat period
    await call("join", {"worker_id": wid, "generation": 0})

    async def heartbeats() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            await call("heartbeat", {"worker_id": wid, "step": step, "generation": 0})
            try:
                # +-10% jitter, as real workers heartbeat at their own step boundaries (a burst after a
                # stall does not stay synchronized)
                await asyncio.wait_for(stop.wait(), timeout=args.heartbeat_s * rng.uniform(0.9, 1.1))
            except TimeoutError:
                pass

    hb = asyncio.create_task(heartbeats())
    try:
        n = 0
        while True:
            n += 1
            g = await call("lease", {"worker_id": wid, "generation": 0, "request_id": f"{wid}-{n}"})
            if g is None:
                await asyncio.sleep(0.5)
                continue
            if g["action"] == "finished":
                break
            if g["action"] != "task":  # nothing TODO now (tasks in flight elsewhere): ask again later
                await asyncio.sleep(args.task_s / 2)
                continue
            task = g["task"]
            await asyncio.sleep(rng.uniform(args.task_s / 2, 1.5 * args.task_s))
            rows = task["row_end"] - task["row_start"]
            out = await call("done", {"worker_id": wid, "task_id": task["task_id"], "samples": rows,
                                      "generation": 0})
            if out is not None and out["accepted"]:
                ledger.append([wid, task["task_id"], task["shard"], task["row_start"], task["row_end"]])
            elif out is not None:
                errors[f"done rejected: {out['status']}"] += 1
    finally:
        hb.cancel()


async def _client_main(args: argparse.Namespace) -> dict[str, Any]:
    import httpx  # lazy: only the client subprocesses use the async client

    token = Path(args.token_file).read_text().strip()
    lat: dict[str, list[float]] = defaultdict(list)
    ledger: list[list[Any]] = []
    errors: Counter = Counter()
    stop = asyncio.Event()
    n = args.hi - args.lo
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=args.url, headers={"Authorization": f"Bearer {token}"},
                                 timeout=60.0, limits=limits) as http:
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        conns = [_HttpxConn(http) if args.http == "httpx" else _Conn(args.url, token) for _ in range(n)]
        workers = [asyncio.create_task(_worker(conns[i - args.lo], f"w{i:05d}", args, lat, ledger, errors, t0,
                                               stop)) for i in range(args.lo, args.hi)]
        await asyncio.wait_for(asyncio.gather(*workers), timeout=args.duration * 4 + 120)
        stop.set()
        wall = time.perf_counter() - t0
        for c in conns:
            if isinstance(c, _Conn) and c.streams is not None:
                c.streams[1].close()
    return {"latency_ms": lat, "ledger": ledger, "errors": dict(errors), "wall_s": wall,
            "cpu_s": time.process_time() - cpu0}


# ---- master side -----------------------------------------------------------------------------
class _Timing:
    """ASGI wrapper of the master's app: time spent inside the master per endpoint (bench only)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.ms: dict[str, list[float]] = defaultdict(list)
        self.record = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        start = time.perf_counter()
        await self.app(scope, receive, send)
        if self.record and scope["type"] == "http":
            self.ms[scope["path"].strip("/")].append((time.perf_counter() - start) * 1000.0)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def run_one(n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from recforge.elastic.master.service import JobMaster, tune_gc_for_serving  # lazy: not in the clients
    from recforge.elastic.master.state_log import read_master_state  # lazy: as above

    # about n * duration / task_s tasks, so that n workers finish the job in about `duration` seconds
    tasks = max(SHARDS, int(n * args.duration / args.task_s))
    per_shard = -(-tasks // SHARDS)
    shard_rows = [per_shard * ROWS_PER_TASK] * SHARDS
    state_file = work / f"n{n}" / "master_state.json"
    token_file = work / f"n{n}" / "master.token"
    master = JobMaster(shard_rows, rows_per_task=ROWS_PER_TASK, epochs=1, state_file=state_file,
                       lease_timeout_s=60.0)
    token_file.write_text(master.token)
    tune_gc_for_serving()  # as the master's own process does (recforge.elastic.master.main)
    timing = _Timing(master.app)
    master.app = timing
    master.start()
    procs = max(1, min(args.client_procs, n // 8 or 1))
    bounds = [round(i * n / procs) for i in range(procs + 1)]
    outs = [work / f"n{n}" / f"client{i}.json" for i in range(procs)]
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    threading.Timer(args.warmup_s, lambda: setattr(timing, "record", True)).start()
    children = [subprocess.Popen(
        [sys.executable, __file__, "--client", "--url", master.url, "--token-file", str(token_file),
         "--lo", str(bounds[i]), "--hi", str(bounds[i + 1]), "--out", str(outs[i]),
         "--duration", str(args.duration), "--task-s", str(args.task_s), "--heartbeat-s", str(args.heartbeat_s),
         "--warmup-s", str(args.warmup_s), "--http", args.http]) for i in range(procs)]
    try:
        for c in children:
            c.wait(timeout=args.duration * 4 + 180)
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    master_cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    memory = master.state()
    in_memory = master.queue.to_dict()
    master.stop()
    persisted = read_master_state(state_file)
    if any(c.returncode != 0 for c in children):
        raise RuntimeError(f"N={n}: a client process failed: {[c.returncode for c in children]}")
    results = [json.loads(p.read_text()) for p in outs]

    lat: dict[str, list[float]] = defaultdict(list)
    ledger: list[list[Any]] = []
    errors: Counter = Counter()
    for r in results:
        for k, v in r["latency_ms"].items():
            lat[k].extend(v)
        ledger.extend(r["ledger"])
        errors.update(r["errors"])
    # the ledger proof: every row of the job in exactly one accepted done, and the master agrees
    rows = Counter((s, row) for _, _, s, a, b in ledger for row in range(a, b))
    every = {(s, row) for s, k in enumerate(shard_rows) for row in range(k)}
    twice = sum(1 for c in rows.values() if c > 1)
    lost = len(every - set(rows))
    done_ids = Counter(t for _, t, *_ in ledger)
    proof = {
        "rows": len(every), "rows_in_ledger_once": sum(1 for c in rows.values() if c == 1),
        "rows_lost": lost, "rows_done_twice": twice, "tasks_done_twice": sum(1 for c in done_ids.values() if c > 1),
        "master_finished": memory["finished"], "master_rows_done": memory["rows_done_total"],
        "master_tasks_done": memory["tasks_done"], "ledger_tasks": len(ledger),
        "persisted_equals_memory": persisted["queue"] == json.loads(json.dumps(in_memory)),
    }
    proof["ok"] = (lost == 0 and twice == 0 and proof["tasks_done_twice"] == 0 and memory["finished"]
                   and memory["rows_done_total"] == len(every) == sum(b - a for *_, a, b in ledger)
                   and memory["tasks_done"] == len(ledger) and proof["persisted_equals_memory"])
    requests = sum(len(v) for v in lat.values())
    steady = wall - args.warmup_s
    return {
        "workers": n, "client_procs": procs, "tasks": len(ledger), "wall_s": round(wall, 2),
        "tasks_per_s": round(len(ledger) / wall, 1),
        "requests_per_s": round(requests / steady, 1) if steady > 0 else None,
        "latency_ms": {k: {"n": len(v), "p50": _pct(v, 0.5), "p99": _pct(v, 0.99), "max": _pct(v, 1.0)}
                       for k, v in sorted(lat.items())},
        "in_master_ms": {k: {"n": len(v), "p50": _pct(v, 0.5), "p99": _pct(v, 0.99), "max": _pct(v, 1.0)}
                         for k, v in sorted(timing.ms.items()) if k in ENDPOINTS},
        "master_cpu_s": round(master_cpu, 2), "master_cpu_ms_per_request": round(1000 * master_cpu /
                                                                                   max(1, requests), 3),
        "clients_cpu_s": round(sum(r["cpu_s"] for r in results), 2),
        "errors": dict(errors), "proof": proof,
        "state_bytes": state_file.stat().st_size,
    }


def _table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console  # lazy: only for printing
    from rich.table import Table  # lazy: as above

    t = Table(title="job master under load (latency as the clients saw it; in-master p99 in brackets)")
    for col in ("workers", "req/s", "tasks/s", "heartbeat p50/p99 ms", "lease p50/p99 ms", "done p50/p99 ms",
                "master CPU ms/req", "ledger"):
        t.add_column(col, justify="right")
    for r in rows:
        def cell(ep: str, r: dict[str, Any] = r) -> str:
            c, m = r["latency_ms"].get(ep, {}), r["in_master_ms"].get(ep, {})
            return f"{c.get('p50')}/{c.get('p99')} [{m.get('p99')}]"
        p = r["proof"]
        t.add_row(str(r["workers"]), str(r["requests_per_s"]), str(r["tasks_per_s"]), cell("heartbeat"),
                  cell("lease"), cell("done"), str(r["master_cpu_ms_per_request"]),
                  "ok" if p["ok"] else f"FAIL lost={p['rows_lost']} twice={p['rows_done_twice']}")
    Console().print(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="16,128,1024")
    p.add_argument("--duration", type=float, default=30.0, help="about how long each N runs (s)")
    p.add_argument("--task-s", type=float, default=3.0, help="mean time a worker spends on a task (s)")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--warmup-s", type=float, default=3.0, help="latencies of the first seconds are not counted")
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--http", choices=("raw", "httpx"), default="raw",
                   help="the clients' HTTP: raw asyncio streams (cheap) or httpx.AsyncClient")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "master.json"))
    # client subprocess mode
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--token-file", help=argparse.SUPPRESS)
    p.add_argument("--lo", type=int, help=argparse.SUPPRESS)
    p.add_argument("--hi", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        try:
            import uvloop  # lazy: the faster event loop when installed
            uvloop.install()
        except ImportError:
            pass
        out = asyncio.run(_client_main(args))
        Path(args.out).write_text(json.dumps(out))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-master-") as tmp:
        for n in [int(x) for x in args.workers.split(",")]:
            load0 = os.getloadavg()
            r = run_one(n, args, Path(tmp))
            r["loadavg_before"] = [round(x, 2) for x in load0]
            rows.append(r)
            print(json.dumps({k: r[k] for k in ("workers", "requests_per_s", "tasks_per_s", "latency_ms", "proof")}))
    report = {"bench": "master", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "cpus": os.cpu_count(), "settings": {k: getattr(args, k) for k in
                                                   ("duration", "task_s", "heartbeat_s", "warmup_s",
                                                    "client_procs", "http")},
              "goal": "1024 workers at 1 heartbeat/s: p99 < 50 ms", "runs": rows,
              "p99_ms_at_max": max((v["p99"] or 0) for v in rows[-1]["latency_ms"].values()) if rows else None}
    write_report(Path(args.out), report)
    _table(rows)
    return 0 if all(r["proof"]["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
