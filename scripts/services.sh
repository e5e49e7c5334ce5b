#!/usr/bin/env bash
# The local recforge services (make up / make down): Airflow api-server, scheduler, dag-processor and triggerer
# (recforge_daily's wait_for_data sensor defers to it), and the MLflow tracking server, each in its own process group with a log in $RECFORGE_HOME/logs/<name>.log and a
# pid file in $RECFORGE_HOME/run/<name>.pid. Environment: scripts/env.sh.
# Every service runs with RECFORGE_SERVICES_HOME=$RECFORGE_HOME in its environment, and so does everything it
# starts (task processes, a job's torchrun and ranks): `down` finds the platform's processes by it, wherever
# they were re-parented, and returns only when none runs (docs/fault_tolerance.md#shutdown-and-orphans).
# usage: scripts/services.sh up|down|status
#   RECFORGE_VENV        venv with airflow and mlflow (default <repo>/.venv)
#   RECFORGE_UP_TIMEOUT  seconds to wait for the health checks (default 300)
#   RECFORGE_DOWN_GRACE  seconds down waits after each SIGTERM step before the next one, SIGKILL last (default 30)
#   RECFORGE_SOURCE_URI  the landing zone recforge_daily waits for and reads (its source_uri Param's default;
#                        default $RECFORGE_HOME/landing/day_{ds}.tsv.gz, `recforge land-synthetic` seeds it; set but
#                        empty: synthetic days)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/env.sh
. "$ROOT/scripts/env.sh"
VENV=${RECFORGE_VENV:-$ROOT/.venv}
BIN=$VENV/bin
LOGS=$RECFORGE_HOME/logs
RUN=$RECFORGE_HOME/run
TIMEOUT=${RECFORGE_UP_TIMEOUT:-300}
GRACE=${RECFORGE_DOWN_GRACE:-30}
MARK=RECFORGE_SERVICES_HOME   # MARK=$RECFORGE_HOME: in the environment of every process of the platform
unset "$MARK"                 # this script's own children are not the platform's
AIRFLOW_URL=http://$AIRFLOW__API__HOST:$AIRFLOW__API__PORT   # the servers this script starts
MLFLOW_URL=http://$RECFORGE_HOST:$RECFORGE_MLFLOW_PORT
PASSWORDS=$AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE
NOTED=()
SERVICES=(api-server scheduler dag-processor triggerer mlflow)
ALL_SERVICES=("${SERVICES[@]}")   # what down and status look for
export RECFORGE_SOURCE_URI=${RECFORGE_SOURCE_URI-$RECFORGE_HOME/landing/day_\{ds\}.tsv.gz}
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

# A service runs when its pid file names a live process (not a zombie) that still leads its own process group.
running() {
    local pid pgid stat
    pid=$(pid_of "$1") || return 1
    read -r pgid stat < <(ps -o pgid=,stat= -p "$pid" 2>/dev/null) || return 1
    [[ $pgid == "$pid" && $stat != Z* ]]
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
    # setsid: the service leads a new process group, so down can stop it together with its workers; the mark is
    # inherited by everything it starts
    setsid env "$MARK=$RECFORGE_HOME" "${CMD[@]}" >>"$LOGS/$name.log" 2>&1 </dev/null &
    echo $! >"$RUN/$name.pid"
    say "started $name (pid $!, log $LOGS/$name.log)"
}

descendants() {  # every process below pid $1, whatever its process group or session
    ps -eo pid=,ppid= | awk -v root="$1" '{ parent[$1] = $2 }
        END { for (p in parent) { q = p; while ((q in parent) && q != root && q > 1) q = parent[q]; if (q == root && p != root) print p } }'
}

# pid, session and command of every live process of this RECFORGE_HOME's platform: the mark in its environment, or
# noted in $NOTED (a process that rewrites its title, as Airflow's do, hides its environment); this script's session
# (the caller's shell) excepted
platform_ps() {
    local f n pids=() mysid
    for n in "${NOTED[@]}"; do [[ $(started "${n%:*}") == "${n#*:}" ]] && pids+=("${n%:*}"); done  # not a reused pid
    for f in $(grep -lsxzF -- "$MARK=$RECFORGE_HOME" /proc/[0-9]*/environ); do f=${f#/proc/}; pids+=("${f%/environ}"); done
    ((${#pids[@]})) || return 0
    mysid=$(ps -o sid= -p $$ | tr -d ' ')
    ps -o pid=,sid=,stat=,args= -p "$(IFS=,; echo "${pids[*]}")" 2>/dev/null |
        awk -v me="$mysid" '$2 != me && $3 !~ /^Z/ { $3 = ""; sub(/  /, " "); print substr($0, 1, 200) }' || true
}

started() {  # pid -> its start time (clock ticks since boot; field 22 of /proc/<pid>/stat, after the command)
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
    read -r -a stat <<<"${stat##*) }"
    echo "${stat[19]}"
}

server_sids() {  # the sessions of the servers (api-server, mlflow): stopped after everything that uses them
    local name
    for name in api-server mlflow; do running "$name" && pid_of "$name"; done
    return 0
}

# the platform's processes outside the servers' sessions (scheduler side, task processes, jobs, orphans)
others_ps() { platform_ps | awk -v servers=" $(server_sids | tr '\n' ' ') " 'index(servers, " " $2 " ") == 0'; }

groups_alive() { local name; for name in "$@"; do running "$name" && return 0; done; return 1; }
nonempty() { [[ -n $("$@") ]]; }

wait_until_gone() {  # seconds, command...: until the command reports nothing (0) or the time is up (1)
    local end=$((SECONDS + $1)); shift
    while "$@"; do ((SECONDS < end)) || return 1; sleep 0.5; done
}

stop_services() {  # names: SIGTERM each running service's process group
    local name
    for name in "$@"; do
        running "$name" || continue
        say "stopping $name (process group $(pid_of "$name"))"
        kill -TERM -- "-$(pid_of "$name")" 2>/dev/null || true
    done
}

signal_each() {  # signal, "pid sid command" lines: send it to each, saying so
    local sig=$1 pid cmd
    while read -r pid _ cmd; do
        [[ -n $pid ]] || continue
        say "$sig $pid: $cmd"
        kill "-$sig" "$pid" 2>/dev/null || true
    done <<<"$2"
}

airflow_healthy() {  # api-server answers and reports the scheduler, the dag-processor and the triggerer healthy
    curl -fsS --max-time 5 "$AIRFLOW_URL/api/v2/monitor/health" 2>/dev/null | "$BIN/python" -c '
import json, sys
h = json.load(sys.stdin)
need = ["metadatabase", "scheduler", "dag_processor", "triggerer"]
sys.exit(0 if all((h.get(k) or {}).get("status") == "healthy" for k in need) else 1)' 2>/dev/null
}

mlflow_healthy() { curl -fsS --max-time 5 "$MLFLOW_URL/health" >/dev/null 2>&1; }

wait_api_server() {
    local deadline=$((SECONDS + TIMEOUT))
    while ((SECONDS < deadline)); do
        running api-server || { log_tail api-server; die "api-server exited during startup (make down, fix, make up)"; }
        curl -fsS --max-time 5 "$AIRFLOW_URL/api/v2/monitor/health" >/dev/null 2>&1 && { say "api-server answers"; return 0; }
        sleep 1
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
        sleep 1
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
    # a running api-server serves this database, migrated before it started: restarting a stopped scheduler side (a
    # crashed scheduler) neither waits for another migrate (~5 s) nor migrates under the live api-server
    if ((need_airflow)) && ! running api-server; then
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

# down: the scheduler side first (its executor passes SIGTERM on to the task processes, which stop their training
# jobs: torchrun and ranks, relaunching nothing), then whatever of the platform still runs outside the servers
# (task processes and jobs in sessions of their own, orphans of a killed task), then the api-server and MLflow;
# GRACE seconds after each SIGTERM step, then SIGKILL for what is left. Exit 0 only when nothing of the platform runs.
down() {
    local name pid left below t0=$SECONDS
    NOTED=()   # the services and everything below them now, whatever their environment says
    for name in "${ALL_SERVICES[@]}"; do
        running "$name" || continue
        pid=$(pid_of "$name")
        read -r -a below <<<"$(descendants "$pid" | tr '\n' ' ')"
        for pid in "$pid" "${below[@]}"; do NOTED+=("$pid:$(started "$pid")"); done
    done
    stop_services scheduler dag-processor triggerer
    wait_until_gone "$GRACE" groups_alive scheduler dag-processor triggerer || say "scheduler side still running after ${GRACE}s"
    left=$(others_ps)
    if [[ -n $left ]]; then
        say "still running after the scheduler stopped:"
        signal_each TERM "$left"
        wait_until_gone "$GRACE" nonempty others_ps || true
    fi
    stop_services api-server mlflow
    wait_until_gone "$GRACE" nonempty platform_ps || true
    left=$(platform_ps)
    if [[ -n $left ]]; then
        say "did not stop within ${GRACE}s of SIGTERM:"
        signal_each KILL "$left"
        wait_until_gone 10 nonempty platform_ps || true
    fi
    for name in "${ALL_SERVICES[@]}"; do running "$name" || rm -f "$RUN/$name.pid"; done
    left=$(platform_ps)
    if [[ -n $left ]]; then
        printf '[services] error: still running after SIGKILL:\n%s\n' "$left" >&2
        return 1
    fi
    say "stopped: nothing of the platform runs (took $((SECONDS - t0))s)"
}

status() {
    local name rc=0
    for name in "${ALL_SERVICES[@]}"; do
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
