"""recforge's Airflow executor (recforge.pipelines.task_executor): its workers preload the task stack, the stack
covers what the stages import inside their functions, and a process forked after the preload runs a task's work."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recforge.pipelines.task_executor import TASK_STACK, preload

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = ROOT / "platform" / "recforge" / "pipelines"
PROBE_TIMEOUT_S = 300


def _imports_inside_functions(path: Path) -> set[str]:
    """Modules imported inside a function of `path` (the stages' lazy imports)."""
    found: set[str] = set()
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
    return found


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path_factory.mktemp("airflow_home")),
           "AIRFLOW__CORE__EXECUTOR": "recforge.pipelines.task_executor.PreloadingLocalExecutor"}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("task_executor_probe.py"))], env=env,
                         capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-4000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "log": out.stderr}


def test_the_stack_preloads_without_failures(probe):
    assert probe["failed"] == {}
    assert {"torch", "torchrec", "fbgemm_gpu", "mlflow", "pyarrow.parquet"} <= set(probe["modules"])


def test_the_stack_covers_every_import_inside_the_pipeline_functions(probe):
    lazy = set().union(*(_imports_inside_functions(p) for p in PIPELINES.rglob("*.py")))
    assert "recforge.train.metrics" in lazy  # the scan sees the stages' lazy imports
    missing = sorted(m for m in lazy if m not in probe["modules"])
    assert not missing, f"imported inside recforge.pipelines functions but not preloaded: {missing}"


def test_the_worker_preloads_before_it_takes_a_task(probe):
    lines = [line for line in probe["log"].splitlines() if "recforge task stack preloaded" in line]
    pids = {int(m.group(1)) for line in lines if (m := re.search(r"\(pid (\d+)\)", line))}
    assert len(lines) == 2, probe["log"][-4000:]  # the probe itself, then the executor's one worker
    assert len(pids) == 2 and probe["parent_pid"] in pids
    assert all(f"{len(TASK_STACK)} of {len(TASK_STACK)} modules" in line for line in lines)


def test_a_process_forked_after_the_preload_runs_torch_pyarrow_and_torchrec(probe):
    assert probe["child_status"] == 0


def test_a_module_that_fails_to_import_is_reported_not_raised():
    failed = preload(("json", "recforge_no_such_module_xyz"))
    assert list(failed) == ["recforge_no_such_module_xyz"]
    assert "ModuleNotFoundError" in failed["recforge_no_such_module_xyz"]
