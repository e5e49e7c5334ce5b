#!/usr/bin/env bash
# Image entrypoint. `docker run IMAGE demo` runs `recforge demo`; the programs the platform's pods run
# (the Airflow Helm chart's `bash -c "exec airflow scheduler"`, `airflow db check-migrations`, the MLflow server,
# torchrun workers) pass through unchanged.
set -euo pipefail
case ${1:-} in
    recforge | airflow | mlflow | python | python3 | torchrun | pytest | bash | sh | env | /*) exec "$@" ;;
    *) exec recforge "$@" ;;
esac
