#!/usr/bin/env bash
# What a spot node of an elastic megatron-autohet job runs at boot: a preemption-notice watcher
# (`autohet watch`) next to this node's torchrun agent (`autohet node`), the agent restarted when
# it fails, never when the node got a notice. Run with --help for the options.
set -euo pipefail

PROG=launch_node.sh
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
EXIT_STOPPED=76     # autohet node's status when the job stopped for good (elastic/rendezvous.py)

usage() {
  cat <<'EOF'
Usage: launch_node.sh [OPTIONS] -- AUTOHET_TRAIN_ARGS...

Run this node's part of an elastic megatron-autohet job (what a spot node runs at boot):

  1. `autohet watch` in the background: the --notice-source clouds' metadata, plus always
     signals: a SIGTERM (Kubernetes), SIGUSR1 (Slurm --signal=B:USR1@N) or SIGINT sent to THIS
     script is passed to the watcher (SIGINT as SIGTERM), never to the agent, and becomes a
     preemption notice in WORK_DIR/notice.json: the workers see it, stop after the same
     iteration on every node, save it, and this node's agent ends. An AWS rebalance
     recommendation in that file is no notice (the workers save, training goes on): a
     signal or a termination notice after it is;
  2. `autohet node ... --notice-file WORK_DIR/notice.json -- AUTOHET_TRAIN_ARGS` (the torchrun
     agent, which checks AUTOHET_TRAIN_ARGS once and hands its workers the job as a file), with
     `--autohet-notice-file WORK_DIR/notice.json` and (unless given) `--autohet-local-ckpt-dir
     WORK_DIR/ckpt` added to the training arguments;
  3. when it exits 0 (the job is done, or this node got a notice and is leaving): stop, exit 0;
     when it exits 76 (the job stopped for good: its checkpoint saves failed): stop, exit 76;
     when it fails otherwise and there is no preemption notice: start it again after
     --restart-delay seconds, at most --max-restarts times, then exit with its status.

Every option can also be given as the environment variable in brackets (the option wins).

Required:
  --rendezvous HOST:PORT   where `autohet rendezvous` runs                   [AUTOHET_RENDEZVOUS]
  --job-id ID              the job's name, one per job (same on every node)  [AUTOHET_JOB_ID]
  --nnodes MIN:MAX         nodes the job needs to start, and at most uses    [AUTOHET_NNODES]

Optional:
  --node-name NAME         this node's name, stable across restarts (default: hostname)
                                                                             [AUTOHET_NODE]
  --nproc-per-node G       workers (GPUs) on this node (default: the entries of
                           CUDA_VISIBLE_DEVICES, else the GPUs nvidia-smi lists, else 1 for a
                           CPU test)                                         [AUTOHET_NPROC_PER_NODE]
  --gpu TYPE               GPU type, a key of configs/gpus.yaml (default: nvidia-smi's name of
                           the first GPU mapped to a catalog key; left to the workers when it
                           maps to none)                                     [AUTOHET_GPU]
  --local-addr ADDR        address the other nodes reach this one at (default: the hostname's)
                                                                             [AUTOHET_LOCAL_ADDR]
  --notice-source SRC      a cloud whose preemption notices to watch: aws, gcp or azure; repeat
                           for several (env: comma-separated). Default: none, signals only
                                                                             [AUTOHET_NOTICE_SOURCES]
  --signal-grace S         seconds between a signal and the node's end: Kubernetes'
                           terminationGracePeriodSeconds, N of Slurm's --signal=B:USR1@N
                           (default 30)                                      [AUTOHET_SIGNAL_GRACE]
  --work-dir DIR           node-local directory for notice.json, ckpt/ (local checkpoints) and
                           launch_node.pid (this script's pid, for a batch script or preStop
                           hook to signal) (default: ${TMPDIR:-/tmp}/autohet-JOB_ID)
                                                                             [AUTOHET_WORK_DIR]
  --autohet EXE            the autohet executable (default: autohet on PATH) [AUTOHET_BIN]
  --venv DIR               use DIR/bin/autohet (a virtual environment with megatron-autohet)
                                                                             [AUTOHET_VENV]
  --max-restarts K         restarts of a failed `autohet node` by this script (default 5)
                                                                             [AUTOHET_LAUNCH_MAX_RESTARTS]
  --restart-delay S        seconds before such a restart (default 10)        [AUTOHET_RESTART_DELAY]
  --loss-timeout S         `autohet node --loss-timeout`: seconds without a keep-alive after
                           which a node is lost without notice (default: autohet node's, 20;
                           the same on every node of a job)                  [AUTOHET_LOSS_TIMEOUT]
  --agent-max-restarts K   `autohet node --max-restarts`: worker restarts inside the agent, one
                           per preemption (default: autohet node's, 1000)    [AUTOHET_AGENT_MAX_RESTARTS]
  --idle-when-done         after the job finished, wait for a signal instead of exiting (for
                           Kubernetes StatefulSets, which restart containers that exit)
                                                                             [AUTOHET_IDLE_WHEN_DONE=1]
  -h, --help               this help

Everything after -- goes to `autohet train` (--plan, --model, --cluster, --iters,
--save-interval, --autohet-s3-uri, ...); do not give --autohet-notice-file there, it is set here.

Exit status: 0 when the job finished or this node left after a preemption notice, 76 when the
job stopped for good (a launcher must not start it again after either); 2 for bad options; else
the last failed `autohet node`'s status.

Example:
  scripts/launch_node.sh --rendezvous head:29400 --job-id gpt-run-1 --nnodes 2:8 \
      --notice-source aws --venv /opt/autohet-venv -- \
      --plan plan.yaml --model configs/models/gpt3-1.3b.yaml --cluster fleet.yaml \
      --iters 10000 --save-interval 100 --autohet-s3-uri s3://my-bucket/gpt-run-1
EOF
}

log() {
  printf '%s %s: %s\n' "$PROG" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*"
}

die() {   # one line naming the problem, exit 2
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  exit 2
}

# ---- options ------------------------------------------------------------------------------------

RENDEZVOUS="${AUTOHET_RENDEZVOUS:-}"
JOB_ID="${AUTOHET_JOB_ID:-}"
NNODES="${AUTOHET_NNODES:-}"
NODE_NAME="${AUTOHET_NODE:-}"
NPROC="${AUTOHET_NPROC_PER_NODE:-}"
GPU="${AUTOHET_GPU:-}"
LOCAL_ADDR="${AUTOHET_LOCAL_ADDR:-}"
SIGNAL_GRACE="${AUTOHET_SIGNAL_GRACE:-30}"
WORK_DIR="${AUTOHET_WORK_DIR:-}"
AUTOHET_EXE="${AUTOHET_BIN:-}"
VENV="${AUTOHET_VENV:-}"
MAX_RESTARTS="${AUTOHET_LAUNCH_MAX_RESTARTS:-5}"
RESTART_DELAY="${AUTOHET_RESTART_DELAY:-10}"
AGENT_MAX_RESTARTS="${AUTOHET_AGENT_MAX_RESTARTS:-}"
LOSS_TIMEOUT="${AUTOHET_LOSS_TIMEOUT:-}"
IDLE_WHEN_DONE="${AUTOHET_IDLE_WHEN_DONE:-0}"
SOURCES=()
if [ -n "${AUTOHET_NOTICE_SOURCES:-}" ]; then
  IFS=',' read -r -a SOURCES <<<"$AUTOHET_NOTICE_SOURCES"
fi
sources_from_flags=0
TRAIN_ARGS=()

need_value() {   # OPTION ARGC
  [ "$2" -ge 2 ] || die "$1 needs a value"
}

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --rendezvous) need_value "$1" $#; RENDEZVOUS="$2"; shift 2 ;;
    --job-id) need_value "$1" $#; JOB_ID="$2"; shift 2 ;;
    --nnodes) need_value "$1" $#; NNODES="$2"; shift 2 ;;
    --node-name) need_value "$1" $#; NODE_NAME="$2"; shift 2 ;;
    --nproc-per-node) need_value "$1" $#; NPROC="$2"; shift 2 ;;
    --gpu) need_value "$1" $#; GPU="$2"; shift 2 ;;
    --local-addr) need_value "$1" $#; LOCAL_ADDR="$2"; shift 2 ;;
    --notice-source)
      need_value "$1" $#
      if [ "$sources_from_flags" = 0 ]; then SOURCES=(); sources_from_flags=1; fi
      SOURCES+=("$2"); shift 2 ;;
    --signal-grace) need_value "$1" $#; SIGNAL_GRACE="$2"; shift 2 ;;
    --work-dir) need_value "$1" $#; WORK_DIR="$2"; shift 2 ;;
    --autohet) need_value "$1" $#; AUTOHET_EXE="$2"; shift 2 ;;
    --venv) need_value "$1" $#; VENV="$2"; shift 2 ;;
    --max-restarts) need_value "$1" $#; MAX_RESTARTS="$2"; shift 2 ;;
    --restart-delay) need_value "$1" $#; RESTART_DELAY="$2"; shift 2 ;;
    --agent-max-restarts) need_value "$1" $#; AGENT_MAX_RESTARTS="$2"; shift 2 ;;
    --loss-timeout) need_value "$1" $#; LOSS_TIMEOUT="$2"; shift 2 ;;
    --idle-when-done) IDLE_WHEN_DONE=1; shift ;;
    --) shift; TRAIN_ARGS=("$@"); break ;;
    *) die "unknown option '$1' (see --help; training arguments go after --)" ;;
  esac
done

[ -n "$RENDEZVOUS" ] || die "--rendezvous HOST:PORT is required (or AUTOHET_RENDEZVOUS)"
[ -n "$JOB_ID" ] || die "--job-id ID is required (or AUTOHET_JOB_ID)"
[ -n "$NNODES" ] || die "--nnodes MIN:MAX is required (or AUTOHET_NNODES)"
[ "${#TRAIN_ARGS[@]}" -gt 0 ] || die "no training arguments: -- then the \`autohet train\` arguments (--plan, --model, ...)"

[[ "$RENDEZVOUS" =~ ^[^:[:space:]]+:[0-9]+$ ]] || die "--rendezvous: got '$RENDEZVOUS', want HOST:PORT"
[[ "$NNODES" =~ ^[0-9]+(:[0-9]+)?$ ]] && [ "${NNODES%%:*}" -ge 1 ] && [ "${NNODES%%:*}" -le "${NNODES##*:}" ] \
  || die "--nnodes: got '$NNODES', want MIN:MAX with 1 <= MIN <= MAX (or N)"
is_number() { [[ "$1" =~ ^[0-9]+([.][0-9]+)?$ ]]; }
is_number "$SIGNAL_GRACE" || die "--signal-grace: got '$SIGNAL_GRACE', want seconds"
is_number "$RESTART_DELAY" || die "--restart-delay: got '$RESTART_DELAY', want seconds"
[ -z "$LOSS_TIMEOUT" ] || is_number "$LOSS_TIMEOUT" \
  || die "--loss-timeout: got '$LOSS_TIMEOUT', want seconds (>= 4)"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "--max-restarts: got '$MAX_RESTARTS', want a count >= 0"
[ -z "$AGENT_MAX_RESTARTS" ] || [[ "$AGENT_MAX_RESTARTS" =~ ^[0-9]+$ ]] \
  || die "--agent-max-restarts: got '$AGENT_MAX_RESTARTS', want a count >= 0"
[ -z "$NPROC" ] || [[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die "--nproc-per-node: got '$NPROC', want a count >= 1"
for source in ${SOURCES[@]+"${SOURCES[@]}"}; do
  case "$source" in
    aws|gcp|azure|signal) ;;
    *) die "--notice-source: got '$source', want aws, gcp or azure" ;;
  esac
done
for arg in "${TRAIN_ARGS[@]}"; do
  case "$arg" in
    --autohet-notice-file|--autohet-notice-file=*)
      die "--autohet-notice-file is set by $PROG (WORK_DIR/notice.json): leave it out of the training arguments" ;;
  esac
done

if [ -n "$AUTOHET_EXE" ]; then
  :
elif [ -n "$VENV" ]; then
  AUTOHET_EXE="$VENV/bin/autohet"
else
  AUTOHET_EXE=autohet
fi
command -v "$AUTOHET_EXE" >/dev/null 2>&1 \
  || die "autohet executable '$AUTOHET_EXE' not found (give --autohet EXE or --venv DIR)"

NODE_NAME="${NODE_NAME:-$(hostname)}"
WORK_DIR="${WORK_DIR:-${TMPDIR:-/tmp}/autohet-$JOB_ID}"
NOTICE_FILE="$WORK_DIR/notice.json"
PID_FILE="$WORK_DIR/launch_node.pid"

# ---- GPUs ---------------------------------------------------------------------------------------

catalog_types() {   # the GPU catalog's keys, one a line
  local catalog="$SCRIPT_DIR/../configs/gpus.yaml"
  if [ -r "$catalog" ]; then
    awk '/^gpus:/ { in_gpus = 1; next }
         /^[^ #]/ { in_gpus = 0 }
         in_gpus && /^  [A-Za-z0-9][^ :]*:[[:space:]]*$/ { sub(/^  /, ""); sub(/:.*/, ""); print }' \
      "$catalog"
  else
    printf '%s\n' A100-40GB A100-80GB H100 H800 H20 H200 V100-32GB T4 L4 A10G L40S RTX-3090 RTX-4090
  fi
}

gpu_type_of_device() {   # DEVICE_NAME -> the catalog key whose every token is in the name
  # (the rule of the elastic workers: "NVIDIA A100-SXM4-80GB" -> A100-80GB, most specific wins)
  catalog_types | LC_ALL=C sort | awk -v device="$1" '
    function tokens(text, out) { text = toupper(text); gsub(/-/, " ", text); return split(text, out, " ") }
    BEGIN { n = tokens(device, have_list); for (i = 1; i <= n; i++) have[have_list[i]] = 1 }
    NF { m = tokens($0, want); ok = 1
         for (i = 1; i <= m; i++) if (!(want[i] in have)) ok = 0
         if (ok && m > best) { best = m; key = $0 } }
    END { if (best) print key }'
}

GPU_NAMES=()
if command -v nvidia-smi >/dev/null 2>&1; then
  while IFS= read -r line; do
    [ -n "$line" ] && GPU_NAMES+=("$line")
  done < <(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true)
fi

if [ -z "$NPROC" ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=',' read -r -a visible <<<"$CUDA_VISIBLE_DEVICES"
    NPROC="${#visible[@]}"
    log "GPUs: $NPROC (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES)"
  elif [ "${#GPU_NAMES[@]}" -gt 0 ]; then
    NPROC="${#GPU_NAMES[@]}"
    log "GPUs: $NPROC (nvidia-smi)"
  else
    NPROC=1
    log "GPUs: none found (no nvidia-smi or no GPU): 1 worker (a CPU test)"
  fi
fi

if [ -z "$GPU" ] && [ "${#GPU_NAMES[@]}" -gt 0 ]; then
  for name in "${GPU_NAMES[@]}"; do
    if [ "$name" != "${GPU_NAMES[0]}" ]; then
      log "warning: GPUs of different kinds on this node ('${GPU_NAMES[0]}', '$name'): using the first"
      break
    fi
  done
  GPU="$(gpu_type_of_device "${GPU_NAMES[0]}")"
  if [ -n "$GPU" ]; then
    log "GPU type: $GPU (nvidia-smi: ${GPU_NAMES[0]})"
  else
    log "warning: nvidia-smi's '${GPU_NAMES[0]}' matches no GPU type of the catalog: give --gpu TYPE (the workers will try to match it themselves)"
  fi
fi

# ---- the watcher, signals, cleanup --------------------------------------------------------------

WATCHER_PID=""
WATCHER_STARTS=0
WATCHER_MAX_STARTS=4
NODE_PID=""
SLEEP_PID=""
IDLING=0

start_watcher() {
  local args=(watch --notice-file "$NOTICE_FILE" --signal-grace "$SIGNAL_GRACE")
  local source
  for source in ${SOURCES[@]+"${SOURCES[@]}"}; do
    [ "$source" = signal ] || args+=(--source "$source")
  done
  args+=(--source signal)
  WATCHER_STARTS=$((WATCHER_STARTS + 1))
  "$AUTOHET_EXE" "${args[@]}" &
  WATCHER_PID=$!
  log "watcher started (pid $WATCHER_PID): $AUTOHET_EXE ${args[*]}"
}

preempted() {   # the notice file says this node is going away; a rebalance recommendation
  # (AWS's advisory: elevated risk) does not: training goes on, and a later SIGTERM or
  # instance-action is still the notice. The file is JSON written by `autohet watch`
  # (Notice.to_json) or write_notice below, one object on one line.
  [ -e "$NOTICE_FILE" ] && grep -q '"kind": *"preempt"' "$NOTICE_FILE" 2>/dev/null
}

check_watcher() {   # notice a watcher that ended: fine after a notice, else start it again
  [ -n "$WATCHER_PID" ] || return 0
  kill -0 "$WATCHER_PID" 2>/dev/null && return 0
  local status=0
  wait "$WATCHER_PID" 2>/dev/null || status=$?
  WATCHER_PID=""
  if preempted; then
    log "watcher ended (status $status): notice in $NOTICE_FILE"
  elif [ "$WATCHER_STARTS" -lt "$WATCHER_MAX_STARTS" ]; then
    log "warning: watcher ended with status $status and no notice: starting it again"
    start_watcher
  else
    log "warning: watcher ended with status $status, $WATCHER_STARTS times: going on without it (signals to $PROG still write the notice)"
  fi
}

write_notice() {   # SIGNAL: the notice the watcher would have written, when it could not
  local signal_name="$1" now deadline tmp
  now="$(date +%s)"
  deadline="$(awk -v now="$now" -v grace="$SIGNAL_GRACE" 'BEGIN { printf "%.3f", now + grace }')"
  tmp="$NOTICE_FILE.tmp.$$"
  printf '{"deadline_unix": %s, "detail": {"signal": "SIG%s", "written_by": "%s"}, "kind": "preempt", "received_unix": %s, "source": "signal"}\n' \
    "$deadline" "$signal_name" "$PROG" "$now" >"$tmp"
  mv -f "$tmp" "$NOTICE_FILE"
  log "wrote the notice $NOTICE_FILE myself (no watcher to write it)"
}

on_signal() {   # SIGNAL: a preemption notice for this node; the agent is left alone
  local signal_name="$1" forward="$1"
  if [ "$IDLING" = 1 ]; then
    log "SIG$signal_name while idle after the job finished: exiting"
    exit 0
  fi
  [ "$forward" = INT ] && forward=TERM     # a background watcher ignores SIGINT
  if preempted; then
    log "SIG$signal_name: the notice is already in $NOTICE_FILE; waiting for the job to stop"
    return 0
  fi
  if [ -e "$NOTICE_FILE" ]; then
    log "SIG$signal_name after a rebalance recommendation: this is the preemption"
  fi
  if [ -n "$WATCHER_PID" ] && kill -0 "$WATCHER_PID" 2>/dev/null; then
    log "SIG$signal_name: passing it to the watcher (SIG$forward) as a preemption notice; the workers save and stop"
    kill -s "$forward" "$WATCHER_PID" 2>/dev/null || true
    for _ in $(seq 50); do    # it writes the file, then exits: up to 5 s
      preempted && break
      kill -0 "$WATCHER_PID" 2>/dev/null || break
      sleep 0.1
    done
  fi
  preempted || write_notice "$signal_name"
}

cleanup() {
  local status=$?
  trap - TERM USR1 INT
  if [ -n "$NODE_PID" ] && kill -0 "$NODE_PID" 2>/dev/null; then
    log "stopping the agent (pid $NODE_PID)"
    kill -s TERM "$NODE_PID" 2>/dev/null || true
  fi
  if [ -n "$WATCHER_PID" ] && kill -0 "$WATCHER_PID" 2>/dev/null; then
    kill -s HUP "$WATCHER_PID" 2>/dev/null || true     # HUP: stops it without writing a notice
    # A watcher that inherited SIGHUP ignored (nohup) cannot take it: KILL after 2 s.
    for _ in $(seq 20); do kill -0 "$WATCHER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -s KILL "$WATCHER_PID" 2>/dev/null || true
  fi
  # A pause's sleep, by its parent pid: a signal handled between `sleep &` and `SLEEP_PID=$!`
  # leaves SLEEP_PID empty, and an orphaned sleep would hold this script's stdout open.
  pkill -P "$$" -x sleep 2>/dev/null || true
  rm -f "$PID_FILE"
  exit "$status"
}

pause() {   # SECONDS, interruptible by the signal traps
  sleep "$1" &
  SLEEP_PID=$!
  wait "$SLEEP_PID" 2>/dev/null || true
  SLEEP_PID=""
}

# ---- main ---------------------------------------------------------------------------------------

mkdir -p "$WORK_DIR"
if [ -e "$NOTICE_FILE" ]; then
  log "removing the notice of an earlier run: $NOTICE_FILE"
  rm -f "$NOTICE_FILE"
fi
echo "$$" >"$PID_FILE"
trap cleanup EXIT
trap 'on_signal TERM' TERM
trap 'on_signal USR1' USR1
trap 'on_signal INT' INT

has_local_ckpt_dir=0
for arg in "${TRAIN_ARGS[@]}"; do
  case "$arg" in
    --autohet-local-ckpt-dir|--autohet-local-ckpt-dir=*) has_local_ckpt_dir=1 ;;
  esac
done
TRAIN_ARGS+=(--autohet-notice-file "$NOTICE_FILE")
[ "$has_local_ckpt_dir" = 1 ] || TRAIN_ARGS+=(--autohet-local-ckpt-dir "$WORK_DIR/ckpt")

NODE_ARGS=(node --rendezvous "$RENDEZVOUS" --job-id "$JOB_ID" --nnodes "$NNODES"
           --nproc-per-node "$NPROC" --node-name "$NODE_NAME" --notice-file "$NOTICE_FILE")
[ -z "$GPU" ] || NODE_ARGS+=(--gpu "$GPU")
[ -z "$LOCAL_ADDR" ] || NODE_ARGS+=(--local-addr "$LOCAL_ADDR")
[ -z "$AGENT_MAX_RESTARTS" ] || NODE_ARGS+=(--max-restarts "$AGENT_MAX_RESTARTS")
[ -z "$LOSS_TIMEOUT" ] || NODE_ARGS+=(--loss-timeout "$LOSS_TIMEOUT")

log "node $NODE_NAME of job $JOB_ID (rendezvous $RENDEZVOUS, nodes $NNODES, $NPROC worker(s)${GPU:+, $GPU}); work dir $WORK_DIR; pid $$"
start_watcher

restarts=0
while :; do
  if preempted; then
    log "preemption notice before the agent started: this node is leaving; not starting it"
    exit 0
  fi
  "$AUTOHET_EXE" "${NODE_ARGS[@]}" -- "${TRAIN_ARGS[@]}" &
  NODE_PID=$!
  log "agent started (pid $NODE_PID): $AUTOHET_EXE ${NODE_ARGS[*]} -- ${TRAIN_ARGS[*]}"
  while kill -0 "$NODE_PID" 2>/dev/null; do
    check_watcher
    pause 0.5
  done
  status=0
  wait "$NODE_PID" 2>/dev/null || status=$?
  NODE_PID=""

  if [ "$status" = 0 ] && ! preempted; then
    log "the job finished (autohet node exited 0)"
    if [ "$IDLE_WHEN_DONE" = 1 ]; then
      IDLING=1
      log "idling until stopped (--idle-when-done)"
      while :; do pause 3600; done
    fi
    exit 0
  fi
  if preempted; then
    log "this node got a preemption notice and its agent ended (status $status): leaving, not restarting"
    exit 0
  fi
  if [ "$status" = "$EXIT_STOPPED" ]; then
    log "the job stopped for good (autohet node exited $status: see its line above): not restarting"
    exit "$status"
  fi
  if [ "$restarts" -ge "$MAX_RESTARTS" ]; then
    log "autohet node failed (status $status) and was restarted $restarts times (--max-restarts $MAX_RESTARTS): giving up"
    exit "$status"
  fi
  restarts=$((restarts + 1))
  log "autohet node failed (status $status): restart $restarts of $MAX_RESTARTS in $RESTART_DELAY s"
  pause "$RESTART_DELAY"
done
