#!/usr/bin/env bash
# The local recforge services (make up / make down): Airflow api-server, scheduler and dag-processor, and the
# MLflow tracking server, each in its own process group with a log in $RECFORGE_HOME/logs/<name>.log and a
# pid file in $RECFORGE_HOME/run/<name>.pid. Environment: scripts/env.sh.
# usage: scripts/services.sh up|down|status
#   RECFORGE_VENV        venv with airflow and mlflow (default <repo>/.venv)
#   RECFORGE_UP_TIMEOUT  seconds to wait for the health checks (default 300)
#   RECFORGE_TRIGGERER   1: also run `airflow triggerer`, which deferrable operators need (recforge's DAGs use
#                        none, so it is off by default); down/status always cover it
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/env.sh
. "$ROOT/scripts/env.sh"
VENV=${RECFORGE_VENV:-$ROOT/.venv}
BIN=$VENV/bin
LOGS=$RECFORGE_HOME/logs
RUN=$RECFORGE_HOME/run
TIMEOUT=${RECFORGE_UP_TIMEOUT:-300}
AIRFLOW_URL=http://$AIRFLOW__API__HOST:$AIRFLOW__API__PORT   # the servers this script starts
MLFLOW_URL=http://$RECFORGE_HOST:$RECFORGE_MLFLOW_PORT
PASSWORDS=$AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE
SERVICES=(api-server scheduler dag-processor mlflow)
ALL_SERVICES=(api-server scheduler dag-processor triggerer mlflow)   # what down and status look for
[[ ${RECFORGE_TRIGGERER:-0} == 1 ]] && SERVICES=(api-server scheduler dag-processor triggerer mlflow)
export PATH=$BIN:$PATH   # task processes launch workers with the venv's python / torchrun

say() { printf '[services] %s\n' "$*"; }
die() { printf '[services] error: %s\n' "$*" >&2; exit 1; }

command_of() {  # name -> CMD array
    case $1 in
        api-server | scheduler | dag-processor | triggerer) CMD=("$BIN/airflow" "$1") ;;
        mlflow)
            # job execution (GenAI jobs: huey consumers, ~1 GB) is of no use to recforge; opt in by exporting it
            CMD=(env "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"
                "$BIN/mlflow" server
                --backend-store-uri "$RECFORGE_MLFLOW_BACKEND"
                --default-artifact-root "$RECFORGE_MLFLOW_ARTIFACTS"
                --serve-artifacts --artifacts-destination "$RECFORGE_MLFLOW_ARTIFACTS"
                --host "$RECFORGE_HOST" --port "$RECFORGE_MLFLOW_PORT" --workers 1) ;;
        *) die "unknown service $1" ;;
    esac
}

address_of() {  # "host port" of a service that listens
    case $1 in api-server) echo "$AIRFLOW__API__HOST $AIRFLOW__API__PORT" ;; mlflow) echo "$RECFORGE_HOST $RECFORGE_MLFLOW_PORT" ;; esac
}

pid_of() { [[ -s $RUN/$1.pid ]] && cat "$RUN/$1.pid"; }

# A service runs when its pid file names a live process that still leads its own process group.
running() {
    local pid
    pid=$(pid_of "$1") || return 1
    kill -0 "$pid" 2>/dev/null && [[ $(ps -o pgid= -p "$pid" | tr -d ' ') == "$pid" ]]
}

port_busy() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }  # host port

log_tail() {  # the last 40 lines written since the service's latest start marker
    say "last lines of $LOGS/$1.log:"
    [[ -f $LOGS/$1.log ]] && tac "$LOGS/$1.log" | sed '/^==== /q' | tac | tail -n 40 >&2 || true
}

start() {
    local name=$1 address
    if running "$name"; then say "$name already running (pid $(pid_of "$name"))"; return; fi
    rm -f "$RUN/$name.pid"
    address=$(address_of "$name")
    # shellcheck disable=SC2086
    if [[ -n $address ]] && port_busy $address; then
        die "$address is taken by a process this script did not start (RECFORGE_AIRFLOW_PORT / RECFORGE_MLFLOW_PORT choose others)"
    fi
    command_of "$name"
    printf '\n==== %s start %s\n' "$(date -Is)" "${CMD[*]}" >>"$LOGS/$name.log"
    # setsid: the service leads a new process group, so down can stop it together with its workers
    setsid "${CMD[@]}" >>"$LOGS/$name.log" 2>&1 </dev/null &
    echo $! >"$RUN/$name.pid"
    say "started $name (pid $!, log $LOGS/$name.log)"
}

descendants() {  # every process below pid $1, whatever its process group or session
    ps -eo pid=,ppid= | awk -v root="$1" '{ parent[$1] = $2 }
        END { for (p in parent) { q = p; while ((q in parent) && q != root && q > 1) q = parent[q]; if (q == root && p != root) print p } }'
}

alive_any() { local p; for p in "$@"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }

stop() {
    local name=$1 pid i p tree
    pid=$(pid_of "$name") || return 0
    # Task processes and the training workers they launch run in process groups (or sessions) of their own:
    # note the whole tree now, before its parents exit and the children are re-parented.
    read -r -a tree <<<"$(descendants "$pid" | tr '\n' ' ')"
    if kill -0 -- "-$pid" 2>/dev/null || alive_any "${tree[@]}"; then
        say "stopping $name (process group $pid${tree:+, ${#tree[@]} processes below it})"
        kill -TERM -- "-$pid" 2>/dev/null || true          # the service shuts its own workers down first
        for ((i = 0; i < 60; i++)); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.5; done
        for p in "${tree[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
        for ((i = 0; i < 20; i++)); do alive_any "${tree[@]}" || break; sleep 0.5; done
        if kill -0 -- "-$pid" 2>/dev/null || alive_any "${tree[@]}"; then
            say "$name did not stop in time: SIGKILL"
            kill -KILL -- "-$pid" 2>/dev/null || true
            for p in "${tree[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
            sleep 1
        fi
    fi
    rm -f "$RUN/$name.pid"
}

airflow_healthy() {  # api-server answers and reports the scheduler and the dag-processor healthy
    curl -fsS --max-time 5 "$AIRFLOW_URL/api/v2/monitor/health" 2>/dev/null | "$BIN/python" -c '
import json, sys
h = json.load(sys.stdin)
need = ["metadatabase", "scheduler", "dag_processor"] + (["triggerer"] if sys.argv[1] == "1" else [])
ok = all((h.get(k) or {}).get("status") == "healthy" for k in need)
sys.exit(0 if ok else 1)' "${RECFORGE_TRIGGERER:-0}" 2>/dev/null
}

mlflow_healthy() { curl -fsS --max-time 5 "$MLFLOW_URL/health" >/dev/null 2>&1; }

wait_api_server() {
    local deadline=$((SECONDS + TIMEOUT))
    while ((SECONDS < deadline)); do
        running api-server || { log_tail api-server; die "api-server exited during startup (make down, fix, make up)"; }
        curl -fsS --max-time 5 "$AIRFLOW_URL/api/v2/monitor/health" >/dev/null 2>&1 && { say "api-server answers"; return 0; }
        sleep 2
    done
    log_tail api-server
    die "api-server did not answer after ${TIMEOUT}s"
}

wait_healthy() {
    local deadline=$((SECONDS + TIMEOUT)) name a=0 m=0
    while ((SECONDS < deadline)); do
        for name in "${SERVICES[@]}"; do
            running "$name" || { log_tail "$name"; die "$name exited during startup (make down, fix, make up)"; }
        done
        ((a)) || { airflow_healthy && a=1 && say "Airflow healthy"; } || true
        ((m)) || { mlflow_healthy && m=1 && say "MLflow healthy"; } || true
        ((a && m)) && return 0
        sleep 2
    done
    ((a)) || { log_tail api-server; log_tail scheduler; }
    ((m)) || log_tail mlflow
    die "services not healthy after ${TIMEOUT}s"
}

up() {
    [[ -x $BIN/airflow && -x $BIN/mlflow ]] || die "no airflow/mlflow in $VENV (run make venv)"
    mkdir -p "$LOGS" "$RUN" "$AIRFLOW_HOME" "$RECFORGE_MLFLOW_ARTIFACTS"
    chmod 700 "$LOGS"   # the api-server log holds the generated admin password
    local name need_airflow=0
    for name in "${SERVICES[@]}"; do [[ $name == mlflow ]] || running "$name" || need_airflow=1; done
    if ((need_airflow)); then
        say "airflow db migrate (log $LOGS/db-migrate.log)"
        "$BIN/airflow" db migrate >>"$LOGS/db-migrate.log" 2>&1 || { log_tail db-migrate; die "airflow db migrate failed"; }
    fi
    # The api-server first: the scheduler's task workers report through its execution API, and a task
    # queued before it answers fails its first attempt.
    for name in api-server mlflow; do start "$name"; done
    wait_api_server
    for name in "${SERVICES[@]}"; do [[ $name == api-server || $name == mlflow ]] || start "$name"; done
    wait_healthy
    # SimpleAuthManager writes the generated password file world-readable
    [[ -e $PASSWORDS ]] && chmod 600 "$PASSWORDS"
    cat <<EOF

recforge services are up
  Airflow  $AIRFLOW_URL   user: admin
           password: $PASSWORDS
  MLflow   $MLFLOW_URL
  logs     $LOGS
  stop     make down
EOF
}

down() {
    local i
    for ((i = ${#ALL_SERVICES[@]} - 1; i >= 0; i--)); do stop "${ALL_SERVICES[i]}"; done
    say "stopped"
}

status() {
    local name rc=0
    for name in "${ALL_SERVICES[@]}"; do
        [[ $name == triggerer && ${RECFORGE_TRIGGERER:-0} != 1 && ! -e $RUN/$name.pid ]] && continue
        if running "$name"; then printf '  %-14s running (pid %s)\n' "$name" "$(pid_of "$name")"
        elif [[ -e $RUN/$name.pid ]]; then printf '  %-14s dead (stale pid file)\n' "$name"; rc=1
        else printf '  %-14s stopped\n' "$name"; rc=1
        fi
    done
    if airflow_healthy; then echo "  Airflow $AIRFLOW_URL healthy"; else echo "  Airflow $AIRFLOW_URL not healthy"; rc=1; fi
    if mlflow_healthy; then echo "  MLflow  $MLFLOW_URL healthy"; else echo "  MLflow  $MLFLOW_URL not healthy"; rc=1; fi
    return $rc
}

case ${1:-} in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
