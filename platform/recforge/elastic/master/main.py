"""The job master as a process of its own: `python -m recforge.elastic.master.main ...`.

For deployments where the master must outlive (or live apart from) the launching process: its own
pod on Kubernetes, or a restarted master in the fault tests. It serves until SIGTERM / SIGINT, or
until every epoch is done when `--exit-when-finished`; a restart with the same `--state-file`
resumes from the persisted state (workers retry their calls meanwhile). The bearer token comes from
`--token-file` (default: env RECFORGE_MASTER_TOKEN_FILE); a file that does not exist yet gets a new token (0600).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path

from recforge.data.manifest import shard_rows_from_manifest
from recforge.elastic.agent.client import TOKEN_FILE_ENV, read_token_file, write_token_file
from recforge.elastic.master.service import JobMaster, tune_gc_for_serving


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recforge.elastic.master.main", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", help="data manifest directory (shard row counts from manifest.json)")
    src.add_argument("--shard-rows", help="comma-separated row counts per shard")
    p.add_argument("--rows-per-task", type=int, required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--state-file", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--lease-timeout-s", type=float, default=120.0)
    p.add_argument("--max-workers", type=int, default=None)
    p.add_argument("--new-launch", action="store_true", help="leases in the state file belong to dead workers")
    p.add_argument("--exit-when-finished", action="store_true")
    p.add_argument("--url-file", default=None, help="write the master's URL here once it listens")
    p.add_argument("--token-file", default=os.environ.get(TOKEN_FILE_ENV),
                   help=f"the job's bearer token (default: env {TOKEN_FILE_ENV}); created (0600) when missing")
    p.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (default: sized from "
                   "the job's data state, at least 1 MiB)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.token_file:
        parser.error(f"--token-file is required (or set {TOKEN_FILE_ENV}): every request must carry the job's token")
    token_file = Path(args.token_file)
    token = read_token_file(token_file) if token_file.exists() else write_token_file(token_file)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s job-master %(levelname)s %(name)s: %(message)s")
    rows = shard_rows_from_manifest(args.manifest) if args.manifest else [int(x) for x in args.shard_rows.split(",")]
    master = JobMaster(
        rows, rows_per_task=args.rows_per_task, epochs=args.epochs, state_file=args.state_file, host=args.host,
        port=args.port, lease_timeout_s=args.lease_timeout_s, max_workers=args.max_workers,
        new_launch=args.new_launch, token=token, max_body_bytes=args.max_body_bytes,
    ).start()
    tune_gc_for_serving()
    if args.url_file:
        tmp = Path(args.url_file + ".tmp")
        tmp.write_text(master.url)
        tmp.replace(args.url_file)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            if args.exit_when_finished and master.queue.finished:
                time.sleep(2.0)  # let the workers read "finished"
                break
    finally:
        master.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
