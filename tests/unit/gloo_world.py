"""`world1`: this test process as a one-rank gloo group (module scope; reused when a group already exists)."""
from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from recforge.elastic.backends.local import free_port


@pytest.fixture(scope="module")
def world1():
    if dist.is_initialized():
        yield
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
