# shellcheck shell=bash
# recforge's embedded defaults, in one sourceable file:  . scripts/env.sh
# scripts/services.sh, the Makefile, the CLI and the tests source it so they all see the same services and stores.
# The same values as recforge.settings.embedded_env() (the CLI's Python side), plus a few service knobs.
#
# Like recforge.settings, every variable keeps a value the environment already has. The knobs:
#   RECFORGE_HOME (default <repo>/.recforge), RECFORGE_HOST (127.0.0.1), RECFORGE_AIRFLOW_PORT (8080),
#   RECFORGE_MLFLOW_PORT (5000), RECFORGE_LOG_SERVER_PORT (8793: the scheduler's task-log server, which Airflow
#   binds to all interfaces; its requests must carry a token signed with this install's [api] secret_key).
# Side effect (once per RECFORGE_HOME): creates $RECFORGE_HOME/secrets/jwt_secret (mode 600).

RECFORGE_REPO=${RECFORGE_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)}
export RECFORGE_REPO
export RECFORGE_HOME=${RECFORGE_HOME:-$RECFORGE_REPO/.recforge}
export RECFORGE_HOST=${RECFORGE_HOST:-127.0.0.1}
export RECFORGE_AIRFLOW_PORT=${RECFORGE_AIRFLOW_PORT:-8080}
export RECFORGE_MLFLOW_PORT=${RECFORGE_MLFLOW_PORT:-5000}
export RECFORGE_LOG_SERVER_PORT=${RECFORGE_LOG_SERVER_PORT:-8793}
export RECFORGE_AIRFLOW_URL=${RECFORGE_AIRFLOW_URL:-http://$RECFORGE_HOST:$RECFORGE_AIRFLOW_PORT}
export RECFORGE_MLFLOW_URL=${RECFORGE_MLFLOW_URL:-http://$RECFORGE_HOST:$RECFORGE_MLFLOW_PORT}
export RECFORGE_MLFLOW_ARTIFACTS=${RECFORGE_MLFLOW_ARTIFACTS:-$RECFORGE_HOME/mlflow/artifacts}

# Airflow 3: LocalExecutor on SQLite, DAGs and plugins straight from the checkout.
export AIRFLOW_HOME=${AIRFLOW_HOME:-$RECFORGE_HOME/airflow}
export AIRFLOW__CORE__DAGS_FOLDER=${AIRFLOW__CORE__DAGS_FOLDER:-$RECFORGE_REPO/dags}
export AIRFLOW__CORE__PLUGINS_FOLDER=${AIRFLOW__CORE__PLUGINS_FOLDER:-$RECFORGE_REPO/plugins}
# LocalExecutor whose workers import the task stack once; every task forked from them inherits it
# (docs/architecture.md#task-start-up)
export AIRFLOW__CORE__EXECUTOR=${AIRFLOW__CORE__EXECUTOR:-recforge.pipelines.task_executor.PreloadingLocalExecutor}
export AIRFLOW__CORE__PARALLELISM=${AIRFLOW__CORE__PARALLELISM:-2}
export AIRFLOW__CORE__LOAD_EXAMPLES=${AIRFLOW__CORE__LOAD_EXAMPLES:-False}
export AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION=${AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION:-False}
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-sqlite:///$AIRFLOW_HOME/airflow.db}
# SQLite only: every Airflow process (scheduler, API server, DAG processor, triggerer, CLI) opens its write
# transactions with BEGIN IMMEDIATE (a deferred read-then-write transaction gets "database is locked" at once, with no
# wait) and waits up to 60 s for another's write lock instead of sqlite3's 5 s
# (recforge.settings.AIRFLOW_SQLITE_CONNECT_ARGS: ImmediateSQLiteConnection).
case $AIRFLOW__DATABASE__SQL_ALCHEMY_CONN in
    sqlite*)
        export AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS=${AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS:-recforge.settings.AIRFLOW_SQLITE_CONNECT_ARGS}
        export AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC=${AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC:-recforge.settings.AIRFLOW_SQLITE_CONNECT_ARGS_ASYNC} ;;
esac
export AIRFLOW__API__HOST=${AIRFLOW__API__HOST:-$RECFORGE_HOST}
export AIRFLOW__API__PORT=${AIRFLOW__API__PORT:-$RECFORGE_AIRFLOW_PORT}
export AIRFLOW__API__BASE_URL=${AIRFLOW__API__BASE_URL:-$RECFORGE_AIRFLOW_URL}
export AIRFLOW__API__WORKERS=${AIRFLOW__API__WORKERS:-1}
export AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=${AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT:-$RECFORGE_LOG_SERVER_PORT}
# Users: SimpleAuthManager's default (user "admin" with role admin: simple_auth_manager_users is "user:role");
# Airflow generates the password into this file on the api-server's first start. No password is set here.
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE:-$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated}

# MLflow: the pipeline logs straight into this SQLite store (file artifacts under $RECFORGE_MLFLOW_ARTIFACTS);
# `mlflow server` (make up) serves the same store and artifacts.
export RECFORGE_MLFLOW_BACKEND=${RECFORGE_MLFLOW_BACKEND:-sqlite:///$RECFORGE_HOME/mlflow/mlflow.db}
export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-$RECFORGE_MLFLOW_BACKEND}

# JWT secret shared by the api-server, the scheduler and the task processes (each would otherwise use its own,
# and tasks could not authenticate to the execution API): 64 random bytes (128 hex characters), generated once
# per RECFORGE_HOME; recforge.settings.jwt_secret() reads and writes the same file.
_recforge_secret() {
    local dir=$RECFORGE_HOME/secrets file tmp
    file=$dir/$1
    if [ ! -s "$file" ]; then
        mkdir -p "$dir" && chmod 700 "$dir" || return 1
        tmp=$(mktemp "$file.XXXXXX") || return 1            # mktemp creates it with mode 600
        head -c 64 /dev/urandom | od -An -vtx1 | tr -d ' \n' >"$tmp"
        mv -n "$tmp" "$file"                                 # a concurrent first run keeps the first secret
        rm -f "$tmp"
    fi
    chmod 600 "$file"
    tr -d '[:space:]' <"$file"
}
if [ -z "${AIRFLOW__API_AUTH__JWT_SECRET:-}" ]; then
    AIRFLOW__API_AUTH__JWT_SECRET=$(_recforge_secret jwt_secret) \
        || { echo "recforge: cannot create $RECFORGE_HOME/secrets/jwt_secret" >&2; unset -f _recforge_secret; return 1 2>/dev/null || exit 1; }
fi
export AIRFLOW__API_AUTH__JWT_SECRET
unset -f _recforge_secret
