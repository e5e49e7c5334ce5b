"""Security defaults: a per-install JWT secret of 64 random bytes readable by the owner only, no secrets in the
repository, and model artifacts that unpickle loaded only through the known loaders."""
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from recforge.settings import jwt_secret

REPO = Path(__file__).resolve().parents[2]
ENV_SH = REPO / "scripts" / "env.sh"


def _sourced(home: Path, var: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW", "RECFORGE_"))}
    env["RECFORGE_HOME"] = str(home)
    out = subprocess.run(["bash", "-c", f'. "{ENV_SH}" && printf %s "${var}"'], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    return out.stdout


def test_env_sh_generates_a_64_byte_jwt_secret_per_install_owner_only(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    secret = _sourced(a, "AIRFLOW__API_AUTH__JWT_SECRET")
    assert re.fullmatch(r"[0-9a-f]{128}", secret), "64 random bytes, hex"
    assert len(set(secret)) > 10
    assert _sourced(a, "AIRFLOW__API_AUTH__JWT_SECRET") == secret, "stable for one install"
    assert _sourced(b, "AIRFLOW__API_AUTH__JWT_SECRET") != secret, "different per install"
    path = a / "secrets" / "jwt_secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    # the CLI's Python side reads the same file
    code = ("import sys; from pathlib import Path; from recforge.settings import jwt_secret; "
            "print(jwt_secret(Path(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", code, str(a)], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == secret


def test_settings_generates_the_secret_with_the_same_strength(tmp_path):
    secret = jwt_secret(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{128}", secret) and jwt_secret(tmp_path) == secret
    assert stat.S_IMODE((tmp_path / "secrets" / "jwt_secret").stat().st_mode) == 0o600


def test_services_bind_loopback_and_no_password_is_set_anywhere():
    env_sh = ENV_SH.read_text()
    assert "RECFORGE_HOST=${RECFORGE_HOST:-127.0.0.1}" in env_sh
    assert "AIRFLOW__API__HOST=${AIRFLOW__API__HOST:-$RECFORGE_HOST}" in env_sh
    assert '--host "$RECFORGE_HOST"' in (REPO / "scripts" / "services.sh").read_text()
    for path in (ENV_SH, REPO / "scripts" / "services.sh", REPO / "platform" / "recforge" / "settings.py"):
        assert not re.search(r"SIMPLE_AUTH_MANAGER_(USERS|ALL_ADMINS)\b", path.read_text()), path


def _repo_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True)
    return [REPO / p for p in out.stdout.splitlines() if (REPO / p).is_file()]


SECRET_PATTERNS = {
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "AWS access key id": re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    "JWT": re.compile(r"\beyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"),
    "hex secret (>= 32 bytes)": re.compile(r"(?<![0-9a-fA-F])[0-9a-f]{64,}(?![0-9a-fA-F])"),
    "password value": re.compile(
        r"""(?i)\b(password|passwd|secret_key|jwt_secret)\b["']?\s*[:=]\s*["'][^"'\s$<{.]{6,}["']"""),
}


def test_no_secrets_in_the_repository():
    found = []
    for path in _repo_files():
        if path.suffix in (".png", ".pt2", ".so", ".whl", ".parquet") or path.stat().st_size > 2_000_000:
            continue
        rel = path.relative_to(REPO)
        if rel.parts[:2] == ("tests", "unit") and path.name == Path(__file__).name:
            continue
        text = path.read_text(errors="replace")
        for name, pattern in SECRET_PATTERNS.items():
            for m in pattern.finditer(text):
                found.append(f"{rel}: {name}: {m.group(0)[:40]}")
        if path.name.startswith("simple_auth_manager_passwords") or path.name == "jwt_secret":
            found.append(f"{rel}: a generated credentials file")
    assert found == []


@pytest.mark.parametrize("sample,name", [
    ('password: "hunter22"', "password value"),
    ("-----BEGIN RSA PRIVATE KEY-----", "private key"),
    ("a" * 64, "hex secret (>= 32 bytes)"),
])
def test_the_secret_scan_finds_what_it_looks_for(sample, name):
    assert SECRET_PATTERNS[name].search(sample)


# Every place that may deserialize a model artifact with pickle (directly or through MLflow / torch; an MLflow
# loader passed to recforge.tracking.model_source.load_trusted counts: it is called once the URI is checked), with why
# it is allowed. A new one fails this test until it is reviewed and listed.
# torch.load(..., weights_only=True) is exempt: torch's restricted unpickler loads tensors and plain containers only
UNPICKLING = re.compile(r"\b(pickle|cloudpickle|dill|joblib)\.loads?\(|torch\.load\(|mlflow\.\w+\.load_model\b")
ALLOWED = {
    # the registered model (pickled TorchRec module), only ever from the configured MLflow registry
    ("platform/recforge/tracking/registry.py", "mlflow.pytorch.load_model"),
    # RECom's compiled model (pyfunc wrapping the pt2 program), from the configured registry (models:/ URI)
    ("platform/recforge/tracking/recom_models.py", "mlflow.pyfunc.load_model"),
    # DLRover-RM's fitted resource model: an MLflow pyfunc (cloudpickled PythonModel), registered and loaded by
    # name / version from the configured registry (or a runs:/ URI of the configured tracking store)
    ("platform/recforge/tracking/resource_models.py", "mlflow.pyfunc.load_model"),
}


def test_model_artifacts_are_unpickled_only_by_the_known_loaders():
    found = set()
    for path in _repo_files():
        rel = path.relative_to(REPO).as_posix()
        if path.suffix != ".py" or not rel.startswith(("platform/", "kernels/", "dags/", "plugins/")):
            continue
        for line in path.read_text().splitlines():
            code = line.split("#")[0]
            if "weights_only=True" in code:  # torch's restricted unpickler: tensors and plain containers only
                continue
            for m in UNPICKLING.finditer(code):
                found.add((rel, m.group(0)))
    assert found <= ALLOWED, f"new unpickling call sites: {sorted(found - ALLOWED)}"
    assert ("platform/recforge/tracking/registry.py", "mlflow.pytorch.load_model") in found
