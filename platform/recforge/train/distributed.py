"""Process-group helpers shared by the launchers of multi-process training (elastic's local backend, RAP's
profile ranks, multi-process tests and benchmarks)."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (bound to port 0, then released): a process group's
    MASTER_PORT or a rendezvous endpoint."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
