"""Entry of one rank's process (`python -m recforge.worker SPEC_JSON`, under torchrun): environment, logging, process
group, exit code; the training itself is recforge.worker.trainer.run.

Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the environment (without them it runs as a
single rank). A failing rank records its exception for the failover policy before it exits. A rank under torchrun
dies with it (SIGKILL by PR_SET_PDEATHSIG, die_with_launcher), and torchrun with the process that launched it: a
killed train task leaves no worker behind to overlap its retry.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist

from recforge.elastic.backends.local import die_with_launcher
from recforge.train.spec import WorkerSpec
from recforge.worker.elastic_client import record_failure


def _env() -> tuple[int, int, int]:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if "MASTER_ADDR" not in os.environ:
        if world != 1:
            raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR is not set: launch under torch.distributed.run")
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    return rank, world, local


def _quiet_logs(rank: int) -> None:
    """Our INFO lines; only errors from torchrec / fbgemm (they log chatty INFO and benign warnings on root)."""
    logging.basicConfig(level=logging.ERROR, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("recforge").setLevel(logging.INFO)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\.")
    # The data_parallel (DENSE) embedding kernel backprops through an fbgemm op registered without an
    # Autograd key; its gradients are checked against a single-process model in the integration tests.
    warnings.filterwarnings("ignore", message=r"fbgemm::dense_embedding_codegen_lookup_function")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m recforge.worker SPEC_JSON", file=sys.stderr)
        return 2
    die_with_launcher()  # under torchrun: SIGKILL with it (a killed train task takes torchrun, torchrun the ranks)
    rank, world_size, local_rank = _env()
    _quiet_logs(rank)
    from recforge.worker.trainer import run  # lazy: after _quiet_logs (importing fbgemm adds a root log handler)

    spec = WorkerSpec.load(argv[0])
    torch.set_num_threads(spec.threads_per_worker)
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    try:
        run(spec, rank, world_size, device)
    except BaseException as e:
        record_failure(spec, rank, e)
        raise
    finally:
        dist.destroy_process_group()
    return 0
