#!/usr/bin/env bash
# Starts this node's part of a multi-node data-parallel training job.
#
#   launch.sh --hosts IP1,IP2,... --job-id ID [--master-port 29500] [--nproc-per-node auto|N]
#             [--jobs-root /fsx/jobs] [--node-address ADDR] [--time-limit SECONDS]
#             [--stop-grace 1800] [--wrap CMD] [--log-folder jobs|precompile]
#             [--resume new|resume] [--dry-run]
#             (--code SHA256 | --code-dir DIR) [--entry SCRIPT.py | --entry '-m MODULE']
#             [--data /fsx/PATH] -- <the entry point's args>
#
# Every node runs the same command line (the RunTraining SSM document sends it to all of
# them). Each finds its rank as the position of its own address in --hosts; the first host
# is the torchrun master. The job runs its code snapshot (--code: job_code.sh fetches, checks
# and unpacks it once per node) and writes to <jobs-root>/<job-id>, which it gets as
# TRAINIUM_OUTPUT_DIR (the reference trainer's --output defaults to it, and --data to
# TRAINIUM_DATA_DIR). --resume resume (the default) resumes from its latest checkpoint or
# starts at step 0 when there is none; --resume new refuses, with the input error's status 2,
# a job ID whose directory holds a checkpoint. TRAINIUM_RESUME is 1 or 0 accordingly.
# The job's output (torchrun, the workers, the compiler) goes only to
# <jobs-root>/<job-id>/logs/node-<rank>-<address>.log and to <log dir>/<log-folder>/<job-id>.log
# on the node (/var/log/trainium-cluster/jobs/ unless --log-folder says precompile: the
# CloudWatch agent ships only the newest file matching a wildcard, so a precompile's log and
# the job's must not share one folder), which the CloudWatch agent ships to the stream
# <instance-id>/<log-folder>. The SSM agent (this script's stdout) gets launch.sh's own lines
# (start, rank, stop, the leg's end, the exit status) and, when torchrun fails, the job's last
# 50 lines (8,000 bytes at most) with where the whole log is: the agent copies output one
# byte per write, and a trainer must never wait for it.
# --time-limit is the SSM command's executionTimeout: --stop-grace seconds before it, the leg
# ends itself (SIGTERM to the trainers, which save a checkpoint and exit) and launch.sh exits
# with status 75, which tells the CLI to start the next leg (a resume) without counting a
# retry. 0 (the default) sets no limit. Any exit status but 0, 1, 3, 4 and 75 (torchrun
# killed by the OOM killer: 137) is reported as 1, which the SSM agent cannot misread
# (report_exit_status in lib.sh). A trainer's own status (torchrun exits 1 for any failed
# worker) is read from torchrun's report and passed on when it is 2 to 127 but 75: 2 says the
# job's own input is wrong (the trainer's bad flag or missing data), which the supervisor does
# not retry; the trainer's error line then goes to stderr. A SIGTERM, SIGINT or SIGHUP stops the leg: the trainers
# first, with --stop-grace seconds to save, then torchrun. The soft open-file limit is
# raised to the hard one before torchrun starts (raise_open_file_limit in lib.sh).
# Whatever ends this script (a cancel or time-out SIGKILLs its process group), a watchdog in
# a session of its own stops the processes it started: nothing of the leg outlives it.
# --wrap runs torchrun under another command (precompile.sh uses neuron_parallel_compile);
# --dry-run prints the environment and the torchrun command line instead of running it.
set -Eeuo pipefail
# shellcheck source=scripts/node/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=scripts/node/job_python.sh
source "$NODE_DIR/job_python.sh"
# shellcheck source=scripts/node/job_code.sh
source "$NODE_DIR/job_code.sh"
trap 'on_err $LINENO "$BASH_COMMAND"' ERR

load_cluster_env || true

hosts_arg="" job_id="" master_port=29500 nproc_arg=auto node_address_arg="" wrap="" dry_run=0
time_limit=0 stop_grace=1800 log_folder=jobs code="" code_dir="" entry="-m workload.train" data=""
resume=resume
jobs_root="${FSX_MOUNT_POINT:-/fsx}/jobs"
while (($#)); do
  case $1 in
    --hosts | --job-id | --master-port | --nproc-per-node | --jobs-root | --node-address | --wrap | \
      --time-limit | --stop-grace | --log-folder | --code | --code-dir | --entry | --data | --resume)
      (($# >= 2)) || die "$1 needs a value (see --help)"
      case $1 in
        --time-limit) time_limit=$2 ;;
        --stop-grace) stop_grace=$2 ;;
        --hosts) hosts_arg=$2 ;;
        --job-id) job_id=$2 ;;
        --master-port) master_port=$2 ;;
        --nproc-per-node) nproc_arg=$2 ;;
        --jobs-root) jobs_root=$2 ;;
        --node-address) node_address_arg=$2 ;;
        --wrap) wrap=$2 ;;
        --log-folder) log_folder=$2 ;;
        --code) code=$2 ;;
        --code-dir) code_dir=$2 ;;
        --entry) entry=$2 ;;
        --data) data=$2 ;;
        --resume) resume=$2 ;;
      esac
      shift 2
      ;;
    --dry-run) dry_run=1 && shift ;;
    -h | --help) usage && exit 0 ;;
    --) shift && break ;;
    *) die "unknown option '$1': options come first, then -- and the entry point's arguments (see --help)" ;;
  esac
done
train_args=("$@")

[[ -n $job_id ]] || die "--job-id is required"
validate_job_id "$job_id"
validate_port --master-port "$master_port"
((master_port < 65535)) || die "--master-port $master_port leaves no port for the Neuron root communicator (port + 1): use at most 65534"
validate_nproc "$nproc_arg"
parse_hosts "$hosts_arg"
if [[ ! $time_limit =~ ^[0-9]{1,6}$ ]] || ((time_limit > 172800)); then
  die "--time-limit '$time_limit' is not allowed: use 0 (no limit) or seconds up to 172800 (the SSM limit of one command)"
fi
[[ $stop_grace =~ ^[0-9]{1,6}$ ]] || die "--stop-grace '$stop_grace' is not a number of seconds"
[[ $log_folder == jobs || $log_folder == precompile ]] ||
  die "--log-folder '$log_folder' is not allowed: use jobs or precompile"
if [[ -n $code && -n $code_dir ]] || [[ -z $code && -z $code_dir ]]; then
  die "give exactly one of --code SHA256 (a snapshot in the data bucket) or --code-dir DIR"
fi
[[ $entry =~ $ENTRY_PATTERN ]] ||
  input_error "--entry '$entry' is not allowed: use a .py script's path inside the code snapshot, or -m and a module name"
[[ $resume == new || $resume == resume ]] ||
  die "--resume '$resume' is not allowed: use new (a job ID not used before) or resume"
if ((time_limit > 0 && stop_grace >= time_limit)); then
  die "--stop-grace $stop_grace leaves no time to train within --time-limit $time_limit: use fewer seconds than the limit"
fi
for arg in "${train_args[@]}"; do
  if [[ $arg == --output || $arg == --output=* ]]; then
    die "train.py arguments must not set --output: the job writes to <jobs-root>/<job-id>"
  fi
done

MASTER_PORT=$master_port
find_node_rank "$node_address_arg"
resolve_nproc "$nproc_arg"
export_job_environment

output_dir="$jobs_root/$job_id"

# Tags every process of this job so that stop.sh (and the next attempt) can find them, and
# this leg's so that its watchdog ends them and nothing else.
leg="$(date +%s)-$$"
# Seconds the processes a leg leaves behind (its launcher or torchrun gone) get to exit after
# a SIGTERM before they are SIGKILLed.
LEFTOVER_GRACE=60
export TRAINIUM_JOB_ID="$job_id" TRAINIUM_NODE_ADDRESS="$NODE_ADDRESS" TRAINIUM_NODE_RANK="$NODE_RANK"
# This node's processes are the ones tagged with its state directory (job_pids in lib.sh).
export TRAINIUM_STATE_DIR="$STATE_DIR"
export TRAINIUM_LEG="$leg"
# The job's contract (docs/job-contract.md): where it writes, what it reads, when its leg ends;
# where rank 0 writes its progress, one JSON object a line, which the CloudWatch agent ships
# to <instance-id>/metrics for `cluster.py jobs` (a precompile's graph-only steps are no
# progress); and the unix second at which the leg's SIGTERM comes (0: no time limit).
export TRAINIUM_OUTPUT_DIR="$output_dir" TRAINIUM_CHECKPOINT_DIR="$output_dir/checkpoints"
export TRAINIUM_CODE_SNAPSHOT="$code"
if [[ $log_folder == jobs ]]; then
  export TRAINIUM_METRICS_FILE="$LOG_DIR/metrics/$job_id.jsonl"
fi
TRAINIUM_LEG_DEADLINE=0
if ((time_limit > 0)); then
  TRAINIUM_LEG_DEADLINE=$(($(date +%s) + time_limit - stop_grace - SECONDS))
fi
export TRAINIUM_LEG_DEADLINE

# The code the job runs: the snapshot, unpacked on this node (job_code.sh), or a directory
# as it is (--code-dir: local runs and tests); its root is first on PYTHONPATH and the
# working directory. The entry point is a script in it or a module (torchrun -m).
build_command() {
  export TRAINIUM_CODE_DIR="$code_dir" TRAINIUM_DATA_DIR="$data_dir"
  export PYTHONPATH="$code_dir${PYTHONPATH:+:$PYTHONPATH}"
  local target=("$code_dir/$entry")
  [[ $entry == "-m "* ]] && target=(-m "${entry#-m }")
  command=(torchrun --nnodes "${#HOSTS[@]}" --node_rank "$NODE_RANK"
    --master_addr "${HOSTS[0]}" --master_port "$MASTER_PORT" --nproc_per_node "$NPROC"
    "${target[@]}" "${train_args[@]}")
  if [[ -n $wrap ]]; then
    command=("$wrap" "${command[@]}")
  fi
}

# New or resumed: the job's directory on the shared file system says which it can be. A new
# job whose ID holds a checkpoint is refused before torchrun (the trainer would resume it
# silently, its optimizer and schedule overriding what the new job asked for); a resume
# without a checkpoint starts at step 0 and says so. The trainer reads TRAINIUM_RESUME.
checkpoint=$(latest_checkpoint "$output_dir")
if [[ $resume == new && -n $checkpoint ]]; then
  input_error "job $job_id exists at step ${checkpoint%% *} (${checkpoint#* }): resume it with train --resume $job_id, or choose another --job-id"
elif [[ $resume == new ]]; then
  log "job $job_id: a new job: it starts at step 0"
elif [[ -n $checkpoint ]]; then
  log "job $job_id: resuming from step ${checkpoint%% *} (${checkpoint#* })"
else
  log "job $job_id: resume asked, but $output_dir holds no checkpoint: it starts at step 0"
fi
TRAINIUM_RESUME=0
[[ $resume == new ]] || TRAINIUM_RESUME=1
export TRAINIUM_RESUME

if ((dry_run)); then
  [[ -n $code_dir ]] || code_dir="$CODE_CACHE/$code"
  data_dir=""
  [[ -z $data ]] || data_dir=$(fsx_path "$data")
  build_command
  env | grep -E '^(FI_|NEURON_|CCOM_|GLOO_|MALLOC_ARENA_MAX|TRAINIUM_|PYTHONPATH)' | sort
  printf '%q ' "${command[@]}"
  echo
  exit 0
fi

require_ready
activate_python
mkdir -p "$output_dir/logs"
if [[ -n ${TRAINIUM_METRICS_FILE:-} ]]; then
  mkdir -p "${TRAINIUM_METRICS_FILE%/*}" 2>/dev/null ||
    log "no progress for cluster.py jobs: cannot create ${TRAINIUM_METRICS_FILE%/*}"
fi
node_log="$output_dir/logs/node-$NODE_RANK-$NODE_ADDRESS.log"
log_files=("$node_log")
cloudwatch="none ($LOG_DIR/$log_folder is not writable)"
if mkdir -p "$LOG_DIR/$log_folder" 2>/dev/null && [[ -w $LOG_DIR/$log_folder ]]; then
  log_files+=("$LOG_DIR/$log_folder/$job_id.log")
  # The CloudWatch agent's entry for this folder (phase_monitoring in bootstrap.sh).
  cloudwatch="log group ${TRAINING_LOG_GROUP:-(TRAINING_LOG_GROUP unset)}, stream ${INSTANCE_ID:-<instance-id>}/$log_folder"
fi
# The job's output (torchrun's, the workers', the compiler's) goes to the node's log files
# only, through a tee of its own that nothing but the files slows down. The SSM agent copies
# a script's output one byte per write (aws/amazon-ssm-agent
# agent/framework/processor/executer/iohandler/iomodule/fileS3.go, bufio.ScanBytes), slower
# than 32 trainers log: a trainer writing into that full pipe would wait on its own log lines.
# The agent gets launch.sh's own lines (log, through LOG_COPY_FD the files too) and, when
# torchrun fails, the end of the job's output (show_job_tail). The tee is not tagged as part
# of the job: stopping leftovers below must not end it. Never tagged, not even for a moment:
# the subshell holds launch.sh's own, untagged, environment (/proc/<pid>/environ is what a
# process was exec'd with) and execs tee without the tags. `env -u ... tee` would be exec'd
# with them, and a stop_job that read its environ before it exec'd tee, which a busy machine
# makes likely, ended the tee as a leftover worker: launch.sh then died of SIGPIPE (141).
job_log="" job_log_pid=""
open_job_log() {
  exec {job_log}> >(
    unset "${JOB_TAGS[@]}"
    exec tee -a "${log_files[@]}" >/dev/null {agent_err}>&-
  )
  job_log_pid=$!
  LOG_COPY_FD=$job_log
}
# Closes launch.sh's end of the job's log and waits (30 s at most) for its tee to write what
# it holds and exit, which it does once every process of the leg has closed its end.
close_job_log() {
  local tries
  LOG_COPY_FD=""
  exec {job_log}>&-
  for ((tries = 0; tries < 300; tries++)); do
    kill -0 "$job_log_pid" 2>/dev/null || return 0
    untagged_sleep 0.1
  done
  return 1
}
# What the agent gets of a failed job's output: its last TAIL_LINES lines, TAIL_BYTES bytes at
# most. SSM returns the first 24,000 characters of a command's output (GetCommandInvocation's
# StandardOutputContent; MaxStdoutLength in the agent) and the whole of it in CloudWatch: the
# tail, after at most about 3 KB of launch.sh's lines (the torchrun command line holds the
# train.py arguments, 2,048 characters at most in RunTraining), stays well inside the 24,000.
# (ListCommandInvocations' Output shows only the first 2,500 bytes: launch.sh's first lines.)
TAIL_LINES=50 TAIL_BYTES=8000
show_job_tail() {
  close_job_log || log "job $job_id: the job's log is still held open after 30 s; its last lines may be missing below"
  log "job $job_id: the last $TAIL_LINES lines of its output on node rank $NODE_RANK (at most $TAIL_BYTES bytes; the whole log: $node_log, and CloudWatch Logs $cloudwatch):"
  local tail
  tail=$(tail -n "$TAIL_LINES" "$node_log" | tail -c "$TAIL_BYTES" | tr -d '\000')
  printf '%s\n' "$tail"
  open_job_log
}
# A compile that failed or was interrupted stays in the shared Neuron compile cache as a
# failed entry. Its lines in this leg's part of the job's log name it (failed_compile_entries
# in lib.sh): say which entry, at most COMPILE_ENTRIES_SHOWN of them, in the agent's output
# and the job's log. The next attempt compiles it again (--retry_failed_compilation).
COMPILE_ENTRIES_SHOWN=10
show_failed_compiles() {
  local entries entry cache=${NEURON_COMPILE_CACHE_URL:-/var/tmp/neuron-compile-cache}
  entries=$(tail -c +"$((log_start + 1))" "$node_log" 2>/dev/null | failed_compile_entries "$cache" || true)
  [[ -n $entries ]] || return 0
  while read -r entry; do
    log "job $job_id: a Neuron compile failed; its compile cache entry: $entry (the next attempt compiles it again: NEURON_CC_FLAGS has --retry_failed_compilation)"
  done < <(head -n "$COMPILE_ENTRIES_SHOWN" <<<"$entries")
}
# torchrun exits 1 whatever status its failed worker had: the worker's (the root cause of
# torchrun's report, torchrun_root_cause_status in lib.sh) becomes this script's status when
# it is 2 to 127 but 75, which report_exit_status then passes on (PASS_STATUS). 2 is the
# contract's input error (argparse's status, the reference trainer's for a bad flag or
# missing data): the supervisor does not retry it, and the agent's stderr gets one line with
# the trainer's own error line.
read_trainer_status() {
  local worker line
  ((status == 1)) || return 0
  worker=$(tail -c +"$((log_start + 1))" "$node_log" 2>/dev/null | torchrun_root_cause_status || true)
  [[ $worker =~ ^[0-9]+$ ]] && ((worker >= 2 && worker <= 127 && worker != 75)) || return 0
  status=$worker PASS_STATUS=$worker
  log "job $job_id: the trainer on node rank $NODE_RANK exited with status $worker (torchrun's root cause); reporting $worker"
  ((worker == 2)) || return 0
  line=$(tail -c +"$((log_start + 1))" "$node_log" 2>/dev/null | trainer_error_line || true)
  log "job $job_id: the job's own input is wrong (status 2): ${line:-see the job log}; it is not retried"
  printf 'job %s: input error (status 2) on node rank %s: %s' "$job_id" "$NODE_RANK" \
    "${line:-see the job log $node_log}" >&"$agent_err"
}
# launch.sh's own errors (a failing tool's message) go to the agent's stdout, as its lines do.
# The agent's stderr (agent_err) gets one line only, for a job whose input is wrong
# (read_trainer_status): the API's Output of an invocation keeps the first characters of stdout
# and the whole of a short stderr (2,500 in all: truncateOutput in the agent's
# iohandler.go), so that line reaches the supervisor's cause however long stdout is.
exec {agent_err}>&2 2>&1
AGENT_ERR=$agent_err
# Where this leg's part of the job's log begins (a resumed job appends to the same log).
log_start=$(stat -c %s "$node_log" 2>/dev/null || echo 0)
open_job_log

log "job $job_id: node rank $NODE_RANK of ${#HOSTS[@]} ($NODE_ADDRESS), $NPROC processes, master ${HOSTS[0]}:$MASTER_PORT"
log "output: $output_dir"
raise_open_file_limit $((${#HOSTS[@]} * NPROC + NOFILE_BASE))
# One job at a time per node: whatever a job left behind holds the NeuronCores.
if stop_job "*" 30 "$NODE_ADDRESS"; then
  log "stopped processes left over from an earlier job or attempt"
fi
if [[ -n $code ]]; then
  unpack_code "$code"
  code_dir=$CODE_DIR
else
  [[ -d $code_dir ]] || input_error "--code-dir $code_dir is not a directory"
  code_dir=$(cd "$code_dir" && pwd)
  log "code: the directory $code_dir as it is (no snapshot)"
fi
if [[ $entry != "-m "* && ! -f $code_dir/$entry ]]; then
  input_error "the entry point $entry is not in the job's code ($code_dir)"
fi
resolve_data "$data"
data_dir=$DATA_DIR
# The snapshot's own Python dependencies (its requirements.txt), installed once per node per
# snapshot before torchrun starts (job_python.sh); a --code-dir runs with the image's Python.
if [[ -n $code ]]; then
  prepare_job_python "$code_dir" "$code"
fi
build_command
cd "$code_dir"
WATCHDOG_LOG="$LOG_DIR/watchdog.log"
[[ -w $LOG_DIR ]] || WATCHDOG_LOG=/dev/null
start_leg_watchdog "$job_id" "$NODE_ADDRESS" "$leg" "$LEFTOVER_GRACE" {job_log}>&- {agent_err}>&-
log "running: ${command[*]}"
log "the job's output goes to $node_log; CloudWatch Logs: $cloudwatch"

"${command[@]}" >&"$job_log" 2>&1 {job_log}>&- {agent_err}>&- &
child=$!
# A stop request (SIGTERM, SIGINT, SIGHUP) stops the leg the way stop.sh stops a job: the
# trainers first, with --stop-grace seconds to save, then torchrun (stop_job in lib.sh says
# why not torchrun first).
# From then on a leg's end (USR1) has nothing to add, nor another stop request: both are
# ignored, and end_leg's recheck ends. A trap that ran during stop_job would run in the middle
# of its command substitutions, whose parse it breaks (end_leg says how): launch.sh ended with
# 2 in the middle of a stop (tests/test_node_wait.py). Defined, with what it calls, before its
# trap is set.
stopping=0
recheck=""
# Ends end_leg's recheck (below), if one is on its way.
stop_recheck() {
  [[ -n $recheck ]] || return 0
  pkill -P "$recheck" 2>/dev/null || true
  kill "$recheck" 2>/dev/null || true
  recheck=""
}
# shellcheck disable=SC2317  # runs from the TERM/INT/HUP trap
stop_leg() {
  trap '' USR1 TERM INT HUP
  stopping=1
  stop_recheck
  log "job $job_id: asked to stop: the trainers get SIGTERM and up to $stop_grace s to save and exit"
  stop_job "$job_id" "$stop_grace" "$NODE_ADDRESS" "$leg" || true
}
trap stop_leg TERM INT HUP
# The leg's end: SIGTERM to the trainers themselves (torchrun's children), not to torchrun,
# which would SIGKILL its workers 30 s later, too soon for a large checkpoint. A trainer gets
# it once it handles SIGTERM (SigCgt in /proc/<pid>/status, proc(5)): one still importing
# would die of it instead of saving. Until torchrun ends, end_leg looks again every
# LEG_END_RECHECK seconds, so a worker that torchrun starts, or that sets its handler, after
# the time limit is asked too.
LEG_END_RECHECK=2
leg_ended=0
signalled=" "
# shellcheck disable=SC2317  # runs from the USR1 trap
end_leg() {
  # A USR1 that comes while this runs is dropped (the recheck below sends another): bash runs
  # a trap in the middle of parsing a command substitution's text, and that parse breaks
  # (bash 5.2.15: "trap: line 2: unexpected EOF while looking for matching `)'", exit 2;
  # tests/test_node_wait.py).
  trap '' USR1
  if ((!leg_ended)); then
    leg_ended=1
    log "job $job_id: leg time limit reached ($((SECONDS)) s of $time_limit, $stop_grace s kept to save): asking the trainers to checkpoint and exit"
  fi
  local pid
  # pgrep fails once torchrun has no child left: no error (the ERR trap would log one).
  for pid in $(pgrep -P "$child" 2>/dev/null || true); do
    [[ $signalled == *" $pid "* ]] && continue
    catches_sigterm "$pid" || continue
    kill -TERM "$pid" 2>/dev/null && signalled+="$pid "
  done
  # A stop that came while this ran (stop_leg ran inside it) ignores the leg's end from then on.
  ((stopping)) && return 0
  stop_recheck
  (
    trap - TERM
    untagged_sleep "$LEG_END_RECHECK" && kill -USR1 $$ 2>/dev/null
  ) {job_log}>&- &
  recheck=$!
  trap end_leg USR1
}
# shellcheck disable=SC2317  # called from end_leg
catches_sigterm() {
  local mask
  mask=$(awk '/^SigCgt:/ { print $2 }' "/proc/$1/status" 2>/dev/null) || return 1
  [[ $mask =~ ^[0-9a-f]+$ ]] && (((16#$mask >> 14) & 1))  # SIGTERM is 15: bit 14
}
# Ends the leg timer and end_leg's recheck: once torchrun has ended, and however launch.sh
# ends (ON_EXIT: a `die`, an error, a fatal signal). Left behind, a timer would hold the agent's
# output pipe open, so the command would not end, for the rest of the leg, then send its USR1
# to a PID that another process may have by then.
timer=""
stop_timers() {
  stop_recheck
  [[ -n $timer ]] || return 0
  pkill -P "$timer" 2>/dev/null || true
  kill "$timer" 2>/dev/null || true
  timer=""
}
ON_EXIT=stop_timers
if ((time_limit > 0)); then
  leg_seconds=$((time_limit - stop_grace - SECONDS))
  ((leg_seconds > 0)) || leg_seconds=1
  (
    trap - TERM
    untagged_sleep "$leg_seconds" && kill -USR1 $$ 2>/dev/null
  ) {job_log}>&- &
  timer=$!
  trap end_leg USR1
  log "job $job_id: leg timer set: the trainers are asked to save and exit in $leg_seconds s (--time-limit $time_limit less the $stop_grace s kept to save)"
fi
# torchrun's status, never from a `wait` that the traps above could interrupt (bash can lose
# the status then: wait_until_reaped in lib.sh), so: until torchrun has ended (a look every
# 0.5 s), then `wait` with the signals ignored. The leg's end has nothing more to do, and a
# USR1 still on its way (end_leg's recheck, or the leg timer firing as torchrun ended) must not
# end this script: ignored, not reset (a signal without a trap ends bash with 128 + its number,
# here 138, and leaves the leftovers running). A stop request from here on has nothing more
# to do either: what torchrun left is stopped below, and the script ends.
wait_until_reaped "$child" 0.5
trap '' USR1 TERM INT HUP
status=0
wait "$child" || status=$?
stop_timers
# torchrun starts its workers in sessions of their own (start_new_session=True): a torchrun
# that died (the OOM killer's SIGKILL) leaves them training, holding the NeuronCores. Stop
# what is left of this leg before reporting, so that the next attempt does not wait for it
# (a stop request from here on has nothing more to do: TERM, INT and HUP stay ignored to the
# end, a minute at most, so that the report below is never cut short: 143 with no report).
if stop_job "$job_id" "$LEFTOVER_GRACE" "$NODE_ADDRESS" "$leg"; then
  log "job $job_id: stopped the processes torchrun left running (it ended with status $status)"
fi
if ((status == 0 && leg_ended)); then
  log "job $job_id: leg ended at its time limit after $SECONDS s with a checkpoint on node rank $NODE_RANK: the next leg resumes it"
  exit 75
elif ((status == 0)) && [[ -e $TERMINATING_MARKER ]]; then
  # The trainers saved and exited 0 because termination_watch.sh stopped them: the node is
  # being terminated, the job is not done. Failed, its supervisor retries it from the
  # checkpoint on the nodes it waits for.
  log "job $job_id: stopped on node rank $NODE_RANK after $SECONDS s because the node is being terminated: reporting 1 so that the job is retried from its checkpoint"
  exit 1
elif ((status == 0)); then
  log "job $job_id: torchrun finished on node rank $NODE_RANK after $SECONDS s"
else
  log "job $job_id: torchrun failed with status $status on node rank $NODE_RANK ($NODE_ADDRESS) after $SECONDS s"
  show_job_tail
  show_failed_compiles
  read_trainer_status
fi
# torchrun's status is reported as is when 0, 1, 3 or 4, else as 1 (report_exit_status in
# lib.sh), unless read_trainer_status found the trainer's own. 75 is launch.sh's own (the
# leg's end above): from torchrun it is a failure.
EXIT_SOURCE=${wrap:-torchrun}
if ((status == 75)); then
  log "torchrun ended with status 75, which only a leg that launch.sh ended at its time limit reports; reporting 1"
  exit 1
fi
exit "$status"
