"""The ranks' allocator settings: which variables a launch adds, and that glibc and Arrow read them by those names."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from recforge.elastic.allocator_env import KEPT, allocator_env, allocator_mode

# in a child: whether a 16 MiB malloc was mmapped (mallinfo2's hblks before and after); Arrow's default pool
PROBE = """
import ctypes, json
import pyarrow as pa
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
class M(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = M
before = libc.mallinfo2().hblks
p = libc.malloc(16 << 20)
print(json.dumps({"mmapped": libc.mallinfo2().hblks - before, "arrow_pool": pa.default_memory_pool().backend_name}))
libc.free(ctypes.c_void_p(p))
"""


def _child(extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in KEPT}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, **extra}, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_default_adds_every_setting_and_names_the_mode():
    assert allocator_env({}) == {"RECFORGE_ALLOCATOR": "kept", **KEPT}
    assert allocator_mode({}) == "kept"


def test_variables_already_set_win_and_system_adds_none():
    got = allocator_env({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert "MALLOC_TRIM_THRESHOLD_" not in got and got["MALLOC_TOP_PAD_"] == KEPT["MALLOC_TOP_PAD_"]
    assert allocator_env({"RECFORGE_ALLOCATOR": "system"}) == {"RECFORGE_ALLOCATOR": "system"}


def test_a_bad_mode_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="RECFORGE_ALLOCATOR='jemalloc'"):
        allocator_env({"RECFORGE_ALLOCATOR": "jemalloc"})


def test_glibc_and_arrow_read_the_settings_by_these_names():
    kept = _child(allocator_env({}))
    system = _child({})
    # 16 MiB is above glibc's default mmap threshold (128 KiB) and below the kept one (32 MiB)
    assert (kept["mmapped"], system["mmapped"]) == (0, 1)
    assert kept["arrow_pool"] == "system" and system["arrow_pool"] != "system"


def test_the_config_default_applies_where_the_env_is_silent_and_the_env_overrides_it():
    assert allocator_env({}, "system") == {"RECFORGE_ALLOCATOR": "system"}
    assert allocator_env({"RECFORGE_ALLOCATOR": "kept"}, "system") == {"RECFORGE_ALLOCATOR": "kept", **KEPT}
    with pytest.raises(ValueError, match="resources.allocator='tcmalloc'"):
        allocator_env({}, "tcmalloc")


def test_the_worker_allocator_param_reaches_both_backends(tmp_path, monkeypatch):
    from recforge.config import PipelineConfig
    from recforge.elastic.backends.k8s_manifests import PodResources, worker_pod
    from recforge.elastic.backends.kubernetes import backend_from_environment
    from recforge.elastic.backends.local import LocalBackend
    from recforge.elastic.job import default_backend
    from recforge.pipelines.dag_tasks import ParamError, config_from_params, default_params

    assert default_params()["worker_allocator"]["default"] == "kept"
    assert default_params()["worker_allocator"]["enum"] == ["kept", "system"]
    resources = PipelineConfig.model_validate(config_from_params({"worker_allocator": "system"})).resources
    assert resources.allocator == "system"
    local = default_backend(resources, tmp_path)
    assert isinstance(local, LocalBackend) and local.allocator == "system"
    monkeypatch.setenv("RECFORGE_IMAGE", "registry.example.com/recforge:test")
    k8s = backend_from_environment(tmp_path / "master", allocator=resources.allocator)
    assert k8s.settings.allocator == "system"
    # the Kubernetes job of a TrainingJob document: its resources reach the worker pods' env
    pods = default_backend(resources.model_copy(update={"backend": "kubernetes"}), tmp_path / "master")
    env = {e["name"]: e.get("value") for e in worker_pod(
        pods.settings, index=0, workers=1, generation=0, spec_path="/x", resources=PodResources(cpu=1, memory="1Gi"),
        threads=1)["spec"]["containers"][0]["env"]}
    assert env["RECFORGE_ALLOCATOR"] == "system" and not set(env) & set(KEPT)
    with pytest.raises(ParamError, match="worker_allocator"):
        config_from_params({"worker_allocator": "jemalloc"})
    with pytest.raises(ValueError, match="resources.allocator='jemalloc'"):
        LocalBackend(allocator="jemalloc")
