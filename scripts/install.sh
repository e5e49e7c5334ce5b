#!/usr/bin/env bash
# Build recforge's Python environment in a virtualenv. The Makefile and the Dockerfile both call this,
# so a laptop and an image install the same things in the same order from the same lock. What to install is
# pyproject.toml's (the one list of direct requirements); requirements/lock.txt pins every version:
#   1. pip itself, pinned by the lock
#   2. [project] dependencies + the `test` extra + the `cpu` extra (fbgemm-gpu-cpu), constrained by the lock
#   3. [tool.recforge.install] no-deps (torchrec) with --no-deps: its declared dependency is the CUDA fbgemm-gpu
#   4. [tool.recforge.install] emulator (kmock, the Kubernetes API emulator the k8s tests start) into
#      VENV/kmock-emulator, outside site-packages
#   5. recforge itself, editable, --no-deps
# Steps 1-4 read only pyproject.toml and the lock (no source tree), so the Dockerfile caches them as one layer.
# The installer is uv ([tool.recforge.install] uv, pinned there: installed by pip into a temporary folder, never
# into the venv) when it can be had: it downloads, installs and compiles in parallel, 2-4x faster than pip for the
# same packages and versions (`pip freeze` identical). uv does not read pip's configuration, so it gets pip's
# effective install options (index / extra index urls, find-links, constraint files, cert, trusted hosts, timeout,
# no cache) on its command line, with pip's rule for choosing among indexes (--index-strategy unsafe-best-match).
# Without uv (no network, no wheel), or when a uv step fails, that step and the rest run with pip. TORCH_SPEC
# installs always use pip. Byte-compilation: see COMPILE.
# usage: scripts/install.sh VENV [deps|project|all]      (deps = steps 1-4, project = step 5)
# env:   PYTHON       interpreter that creates the venv (default python3; must be 3.11)
#        INSTALLER    uv (default) or pip: pip does what uv would, the way it did before uv
#        COMPILE      1 (default): byte-compile what is installed, as pip always did (uv: in parallel); 0: leave it
#                     to the first import. Keep 1: with PYTHONDONTWRITEBYTECODE=1 (set on this project's machines)
#                     or a venv its user cannot write (the image's /opt/venv), nothing is ever written and every
#                     process compiles what it imports again (importing the stack: 12 s compiled, 46 s not).
#        TORCH_SPEC   torch / fbgemm requirements instead of the lock's CPU builds (and no `cpu` extra), e.g.
#                     "torch==2.13.0 fbgemm-gpu==1.8.0" for CUDA builds; the lock's torch / fbgemm pins are then
#                     dropped and CUDA packages are allowed. Point pip at the matching index with PIP_EXTRA_INDEX_URL.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:?usage: scripts/install.sh VENV [deps|project|all]}
PHASE=${2:-all}
LOCK=$ROOT/requirements/lock.txt
PYPROJECT=$ROOT/pyproject.toml
TORCH_SPEC=${TORCH_SPEC:-}

say() { printf '[install] %s\n' "$*"; }

case $PHASE in deps|project|all) ;; *) echo "unknown phase: $PHASE" >&2; exit 2 ;; esac
case ${INSTALLER:-uv} in uv|pip) ;; *) echo "INSTALLER must be uv or pip, not '$INSTALLER'" >&2; exit 2 ;; esac
COMPILE=${COMPILE:-1}
case $COMPILE in 0|1) ;; *) echo "COMPILE must be 0 or 1, not '$COMPILE'" >&2; exit 2 ;; esac

fresh=0
if [[ ! -x $VENV/bin/python ]]; then
    say "creating virtualenv $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
    fresh=1
fi
PY=$VENV/bin/python
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "recforge needs Python 3.11, got " + sys.version' \
    || { echo "$VENV is not a Python 3.11 venv; remove it (make distclean) or set PYTHON" >&2; exit 1; }
PIP=("$PY" -m pip --disable-pip-version-check)
# pip install, minus the per-package warnings about absent find-links / file:// index folders
pip_install() {
    "${PIP[@]}" install "$@" 2>&1 | { grep -v --line-buffered 'is neither a file nor a directory' || true; }
}

# pyproject.toml's lists, one requirement a line: `dependencies`, `extra:NAME` ([project.optional-dependencies])
# or `install:KEY` ([tool.recforge.install]).
pyproject_list() {
    "$PY" - "$PYPROJECT" "$@" <<'EOF'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    doc = tomllib.load(f)
for name in sys.argv[2:]:
    kind, _, key = name.partition(":")
    if kind == "dependencies":
        reqs = doc["project"]["dependencies"]
    elif kind == "extra":
        reqs = doc["project"]["optional-dependencies"][key]
    else:
        reqs = doc["tool"]["recforge"]["install"][key]
    print("\n".join(reqs))
EOF
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
constraints=$LOCK
lists=(dependencies extra:test extra:cpu)
torch_args=()
if [[ -n $TORCH_SPEC ]]; then
    # The lock pins CPU builds; a custom torch needs the lock without its torch / fbgemm lines.
    constraints=$work/constraints.txt
    grep -viE '^(torch|fbgemm[-_]gpu[-_a-z]*)==' "$LOCK" >"$constraints"
    lists=(dependencies extra:test)
    read -r -a torch_args <<<"$TORCH_SPEC"
fi

# uv, when it can be had: pip installs it into $work (not the venv: the lock and `pip freeze` stay uv-free).
use_uv=0
uv_args=()
uv_env=()
setup_uv() {
    [[ ${INSTALLER:-uv} == uv && -z $TORCH_SPEC ]] || return 1
    pyproject_list install:uv >"$work/uv.txt" || return 1
    say "installer: uv ($(tr '\n' ' ' <"$work/uv.txt")from PyPI into a temporary folder)"
    if ! pip_install --quiet --no-deps --target "$work/uv" -r "$work/uv.txt" >"$work/uv.log" 2>&1 \
        || ! "$work/uv/bin/uv" --version >>"$work/uv.log" 2>&1; then
        sed 's/^/[install]   /' "$work/uv.log" >&2
        say "uv could not be installed: installing with pip"
        return 1
    fi
    # pip's effective `pip install` options (its config files and PIP_* variables), as uv options: uv reads no pip
    # configuration. One option, or ENV VAR=value, per line.
    local opts
    opts=$("$PY" - <<'EOF2'
from pip._internal.commands import create_command

o, _ = create_command("install").parse_args([])
out = ["--no-index"] if o.no_index else ["--index-url", o.index_url]
for url in o.extra_index_urls:
    out += ["--extra-index-url", url]
for url in o.find_links:
    out += ["--find-links", url]
for path in o.constraints:
    out += ["--constraint", path]
for host in o.trusted_hosts:
    out += ["--allow-insecure-host", host]
if o.pre:
    out.append("--prerelease=allow")
if o.cert:
    out.append("ENV SSL_CERT_FILE=" + o.cert)
if o.timeout:
    out.append("ENV UV_HTTP_TIMEOUT=%d" % max(1, round(float(o.timeout))))
if not o.cache_dir:  # PIP_NO_CACHE_DIR / --no-cache-dir (the Dockerfile): no cache left behind by uv either
    out.append("ENV UV_NO_CACHE=1")
print("\n".join(out))
EOF2
    ) || { say "could not read pip's configuration for uv: installing with pip"; return 1; }
    local line
    while IFS= read -r line; do
        if [[ $line == "ENV "* ]]; then uv_env+=("${line#ENV }"); else uv_args+=("$line"); fi
    done <<<"$opts"
    # pip chooses among all indexes by version (uv's default would take a package from the first index that has
    # it); no uv.toml / [tool.uv] settings; never download a Python
    uv_args+=(--index-strategy unsafe-best-match --no-config --python "$PY")
    uv_env+=(UV_PYTHON_DOWNLOADS=never)
    use_uv=1
}
# install "$@" (the same arguments for `uv pip install` and `pip install`) with uv, or pip when uv is not used.
# A failed uv step is retried with pip, which also does every later step.
install() {
    if ((use_uv)); then
        local compile=()
        ((COMPILE)) && compile=(--compile-bytecode)
        if env "${uv_env[@]}" "$work/uv/bin/uv" pip install "${uv_args[@]}" "${compile[@]}" "$@"; then
            return 0
        fi
        say "uv failed (above): this step and the rest with pip"
        use_uv=0
        pip_install --quiet --upgrade pip -c "$constraints"
    fi
    if ((COMPILE)); then pip_install "$@"; else pip_install --no-compile "$@"; fi
}

if [[ $PHASE != project ]]; then
    pyproject_list "${lists[@]}" >"$work/requirements.txt"
    if setup_uv; then
        say "1/5 pip: with the requirements (uv)"
        echo pip >>"$work/requirements.txt"
    else
        say "1/5 pip"
        pip_install --quiet --upgrade pip -c "$constraints"
    fi
    say "2/5 requirements: pyproject.toml ${lists[*]} (constrained by $(basename "$LOCK"))"
    install "${torch_args[@]}" -r "$work/requirements.txt" -c "$constraints"
    # (importlib.metadata: 0.1 s, where `pip show` takes seconds)
    if [[ -z $TORCH_SPEC ]] && "$PY" -c 'import importlib.metadata as m; m.distribution("fbgemm-gpu")' 2>/dev/null; then
        # An earlier install without --no-deps let torchrec pull the CUDA fbgemm-gpu over fbgemm-gpu-cpu
        # (both own the fbgemm_gpu/ directory): remove it and restore the CPU build's files.
        say "removing the CUDA fbgemm-gpu and restoring fbgemm-gpu-cpu"
        "${PIP[@]}" uninstall --yes fbgemm-gpu
        pip_install --force-reinstall --no-deps fbgemm-gpu-cpu -c "$constraints"
    fi
    say "3/5 torchrec (--no-deps)"
    pyproject_list install:no-deps >"$work/nodeps.txt"
    install --no-deps -r "$work/nodeps.txt" -c "$constraints"
    say "4/5 Kubernetes emulator for tests (--target $VENV/kmock-emulator)"
    pyproject_list install:emulator >"$work/emulator.txt"
    install --quiet --no-deps --upgrade --target "$VENV/kmock-emulator" -r "$work/emulator.txt"
fi

if [[ $PHASE != deps ]]; then
    say "5/5 recforge (editable, --no-deps)"
    [[ $PHASE == project ]] && setup_uv >/dev/null || true
    install --quiet --no-deps -e "$ROOT"
fi

# Guards: a CPU install contains no CUDA packages unless the lock pins them, and the compiled stack imports.
if [[ -z $TORCH_SPEC ]]; then
    cuda=$("${PIP[@]}" list --format=freeze | grep -iE '^(nvidia-|fbgemm[-_]gpu==|triton==|cuda-)' \
        | grep -vixF -f <(grep -v '^#' "$LOCK") || true)
    if [[ -n $cuda ]]; then
        if ((fresh)); then
            echo "CUDA packages were pulled into a CPU install (not pinned in $LOCK):" >&2; echo "$cuda" >&2; exit 1
        fi
        # an existing venv: somebody installed them by hand; say so, the lock does not know them
        echo "[install] warning: $VENV has CUDA packages that requirements/lock.txt does not pin" \
             "(installed by hand? pin them in the lock or remove them):" >&2
        sed 's/^/[install]   /' <<<"$cuda" >&2
    fi
fi
if [[ -z $TORCH_SPEC ]]; then
    "$PY" -c 'import torch, fbgemm_gpu, torchrec; print("[install] torch", torch.__version__, "+ fbgemm_gpu + torchrec import")'
else  # CUDA fbgemm links the driver's libnvidia-ml, absent on a build host without a GPU
    "$PY" -c 'import torch; print("[install] torch", torch.__version__, "(CUDA build: fbgemm/torchrec import checked on a GPU node)")'
fi
