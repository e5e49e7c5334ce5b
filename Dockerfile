# syntax=docker/dockerfile:1
# The image every recforge pod runs: the `recforge` CLI, the Airflow components and KubernetesExecutor task pods
# (infra/helm), the MLflow server (infra/mlflow) and the training workers (infra/jobs).
# It installs exactly what `make venv` installs, in the same order, from the same lock: scripts/install.sh.
#
# CPU (default):
#   docker build -t recforge:0.1.0 .
# GPU: torch / fbgemm CUDA builds from the PyTorch index, on a CUDA runtime base:
#   docker build -t recforge:0.1.0-cu128 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg TORCH_SPEC="torch==2.13.0 fbgemm-gpu==1.8.0" .
#   A base without Python 3.11 (the CUDA images) gets it from the deadsnakes PPA. The CUDA torch wheels bring their
#   own CUDA libraries, so BASE_IMAGE=python:3.11-slim with the same TORCH_* arguments works on GPU nodes as well;
#   the node provides the driver (NVIDIA container toolkit / device plugin).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# empty: the lock's CPU builds of torch and fbgemm (pyproject's `cpu` extra); otherwise the torch/fbgemm requirements
# to install instead
ARG TORCH_SPEC=""
# where the torch builds live (CPU wheels such as torch==2.13.0+cpu are on the PyTorch CPU index, not on PyPI)
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# uid 50000 / gid 0: what the official Airflow chart runs its pods as
ARG RECFORGE_UID=50000

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    RECFORGE_HOME=/var/lib/recforge

# g++ (and the Python headers): recforge_kernels builds its C++ CPU kernels (preprocessing, the DLRM interaction,
# RECom's embedding layer) on first use, for the node's CPU; without a compiler they fall back to torch ops.
RUN set -eux; \
    apt-get update; \
    if ! command -v python3.11 >/dev/null; then \
        apt-get install -y --no-install-recommends software-properties-common gpg-agent; \
        add-apt-repository -y ppa:deadsnakes/ppa; \
        apt-get update; \
        apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev; \
    fi; \
    apt-get install -y --no-install-recommends tini curl ca-certificates g++; \
    rm -rf /var/lib/apt/lists/*; \
    useradd --uid "${RECFORGE_UID}" --gid 0 --create-home --home-dir /home/recforge --shell /bin/bash recforge; \
    mkdir -p /opt/recforge /opt/airflow "${RECFORGE_HOME}"; \
    chown "${RECFORGE_UID}:0" /opt/airflow "${RECFORGE_HOME}"; \
    chmod g+rwX /opt/airflow "${RECFORGE_HOME}"

WORKDIR /opt/recforge

# Dependencies first (steps 1-4 of scripts/install.sh, from pyproject.toml's lists and the lock): this layer is
# rebuilt only when pyproject.toml, the lock or the script change.
COPY pyproject.toml pyproject.toml
COPY requirements/lock.txt requirements/lock.txt
COPY scripts/install.sh scripts/install.sh
RUN PYTHON=python3.11 PIP_EXTRA_INDEX_URL="${TORCH_INDEX_URL}" TORCH_SPEC="${TORCH_SPEC}" \
    scripts/install.sh /opt/venv deps

# The checkout (see .dockerignore), then recforge itself (step 5: editable, --no-deps), as `make venv` does.
COPY . .
RUN PYTHON=python3.11 TORCH_SPEC="${TORCH_SPEC}" scripts/install.sh /opt/venv project

# Airflow in the pods: DAGs and plugins from this image (infra/helm/airflow-values.yaml sets the same paths).
ENV AIRFLOW__CORE__DAGS_FOLDER=/opt/recforge/dags \
    AIRFLOW__CORE__PLUGINS_FOLDER=/opt/recforge/plugins \
    AIRFLOW__CORE__LOAD_EXAMPLES=False

USER ${RECFORGE_UID}:0
# `recforge ARGS` by default; airflow / mlflow / python / torchrun / bash commands pass through.
ENTRYPOINT ["tini", "--", "/opt/recforge/scripts/docker-entrypoint.sh"]
CMD ["--help"]
