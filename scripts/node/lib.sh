#!/usr/bin/env bash
# Functions shared by the node scripts (bootstrap, launch, preflight, precompile, stop).
# Sourced, never run. Every caller runs under `set -Eeuo pipefail`.
#
# Paths and tools can be redirected through the environment, which is how the local
# rehearsal and the tests run these scripts on a machine that is not a cluster node:
#   TRAINIUM_CLUSTER_ENV  cluster settings file       (/etc/trainium-cluster/cluster.env)
#   TRAINIUM_STATE_DIR    ready marker and lock       (/var/lib/trainium-cluster)
#   TRAINIUM_LOG_DIR      node-local logs             (/var/log/trainium-cluster)
#
# Run Command starts these scripts with `sh` under the SSM agent's systemd service: root, no
# login profile, and systemd's plain PATH (/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:
# /sbin:/bin; aws/amazon-ssm-agent agent/executers/executers.go passes the agent's own
# environment). The Neuron tools (/opt/aws/neuron/bin) and EFA's (/opt/amazon/efa/bin) are
# not on it, and HOME may be unset: node_path below adds what the scripts need.

# shellcheck disable=SC2034  # variables below are read by the scripts that source this file
NODE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CLUSTER_ROOT="$(cd "$NODE_DIR/../.." && pwd)"
ENV_FILE="${TRAINIUM_CLUSTER_ENV:-/etc/trainium-cluster/cluster.env}"
STATE_DIR="${TRAINIUM_STATE_DIR:-/var/lib/trainium-cluster}"
LOG_DIR="${TRAINIUM_LOG_DIR:-/var/log/trainium-cluster}"
READY_MARKER="$STATE_DIR/ready"
# Written by termination_watch.sh when Auto Scaling terminates the node: a job that then ends
# is reported as failed by launch.sh, so that its supervisor retries it rather than finishing it.
TERMINATING_MARKER="$STATE_DIR/terminating"
# Written by bootstrap on every boot: AMI_ID, LAUNCH_TEMPLATE_VERSION, SOFTWARE_VERSION, ...
NODE_ENV_FILE="${TRAINIUM_NODE_ENV:-$(dirname "$ENV_FILE")/node.env}"
# Where the Neuron DLAMI installs the Neuron and EFA tools (Neuron DLAMI and EFA user guides).
NEURON_TOOLS_DIR=/opt/aws/neuron/bin
EFA_TOOLS_DIR=/opt/amazon/efa/bin
SCRIPT_NAME="$(basename "${0%.sh}")"

JOB_ID_PATTERN='^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$'
# The variables launch.sh tags a job's processes with (job_pids); what runs beside the job
# without being part of it (the job's tee, the leg watchdog, launch.sh's own sleeps) unsets them.
JOB_TAGS=(TRAINIUM_JOB_ID TRAINIUM_NODE_ADDRESS TRAINIUM_NODE_RANK TRAINIUM_LEG)
IPV4_PATTERN='^[0-9]{1,3}(\.[0-9]{1,3}){3}$'

# Prints the comment block at the top of the running script (its usage text).
usage() {
  awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
}

# Logs one line to stderr and, while LOG_COPY_FD names an open descriptor, to it as well
# (launch.sh: the job's log files, which the job's own output goes to instead of the agent).
LOG_COPY_FD=""
log() {
  local line
  printf -v line '[%s %s] %s' "$SCRIPT_NAME" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*"
  printf '%s\n' "$line" >&2
  if [[ -n $LOG_COPY_FD ]]; then
    { printf '%s\n' "$line" >&"$LOG_COPY_FD"; } 2>/dev/null || true
  fi
}

LAST_ERROR=""
die() {
  LAST_ERROR="$*"
  log "error: $*"
  exit 1
}

# Reports the command and line that failed; installed by every script with
#   trap 'on_err $LINENO "$BASH_COMMAND"' ERR
on_err() {
  local status=$?
  LAST_ERROR="'$2' failed with status $status at $(basename "${BASH_SOURCE[1]:-$0}") line $1${CURRENT_PHASE:+ (phase $CURRENT_PHASE)}"
  log "error: $LAST_ERROR"
  exit "$status"
}

# The exit statuses a script reports to the SSM agent: 0, 1 (failed), and the contract's
# own, which the job supervisor and the CLI read: 2 (launch: the job's own input is wrong,
# argparse's status for a bad flag; the supervisor does not retry it), 3 (preflight: replace
# this node), 4 (preflight: the nodes run different software), 75 (launch: the leg ended at
# its time limit). launch.sh also passes on a trainer's own status from 2 to 127 (but 75)
# that it read from torchrun's report (PASS_STATUS below: never a failing tool's status), so
# that an operator can name it (`train --no-retry-on`). Any other status is reported as 1,
# because the agent reads some itself: 194 asks
# it to reboot the instance and 137 from a process it did not cancel becomes TimedOut
# (aws/amazon-ssm-agent agent/plugins/pluginutil/pluginutil_unix.go GetStatus;
# RebootExitCode = 194 in agent/appconfig/constants_unix.go). An OOM-killed torchrun (137) or
# a tool's odd status must not pass for either, nor for 168 and 169, which end a document's
# steps early with success or failure (agent/contracts/model.go ExitWithSuccess,
# ExitWithFailure; agent/framework/runpluginutil/runpluginutil.go). report_exit_status, the EXIT trap every
# script that sources this file gets, does the mapping and logs the original status in
# one line; `exit N`, die, on_err (the ERR trap) and the end of the script all pass through
# it. EXIT_SOURCE names what produced the status in that line (the script by default).
# A script that sets an EXIT trap of its own replaces this one (bootstrap.sh, which systemd
# and the user data run, not the agent). ON_EXIT names a function to run first, however the
# script ends (launch.sh: ending its leg timers).
EXIT_SOURCE=""
PASS_STATUS=""
ON_EXIT=""
report_exit_status() {
  local status=$?
  if [[ -n $ON_EXIT ]]; then
    "$ON_EXIT" || true
  fi
  case $status in
    0 | 1 | 3 | 4 | 75) return 0 ;;
  esac
  if [[ -n $PASS_STATUS ]] && ((status == PASS_STATUS && status >= 2 && status <= 127)); then
    return 0
  fi
  log "${EXIT_SOURCE:-$SCRIPT_NAME.sh} ended with status $status ($(status_meaning "$status")); reporting 1"
  exit 1
}
trap report_exit_status EXIT

# The exit status of the worker torchrun names as the root cause of its failure, read from
# torchrun's output (stdin); nothing when there is none. torchrun itself exits 1 whenever a
# worker fails, whatever the worker's status; its ChildFailedError report (torch 2.9,
# torch/distributed/elastic/multiprocessing/errors/__init__.py, ChildFailedError.format_msg)
# ends with "Root Cause (first observed failure):" and the failure's "exitcode  : N (pid: P)"
# (a negative N: killed by signal -N). The error file (TORCHELASTIC_ERROR_FILE) does not help:
# a worker writes it only from a function decorated with @record, and never for sys.exit.
torchrun_root_cause_status() {
  awk '/^Root Cause \(first observed failure\):/ {root = 1; next}
    root && $1 == "exitcode" && $2 == ":" && $3 ~ /^-?[0-9]+$/ {code = $3; root = 0}
    END {if (code != "") print code}'
}

# The trainer's own error line in a failed leg's output (stdin): the last line that says
# "error" outside torchrun's own report of the failure (its glog lines "E1126 01:58:06.641000
# ... elastic/...", its traceback and the ChildFailedError block); nothing when there is none.
trainer_error_line() {
  grep -aiE 'error' | grep -avE 'elastic|error_file|ChildFailedError|^[EWIF][0-9]{4} ' |
    tail -n 1 | tr -d '\000' | cut -c 1-400
}

# The newest complete checkpoint of a job's output directory ($1), as "<step> <path>";
# nothing when it has none. The reference trainer's layout (workload/checkpoint.py):
# <output>/checkpoints/step_<8 digits>/ is complete once it holds model.safetensors,
# trainer_state.pt and config.json.
latest_checkpoint() {
  local dir step="" path="" found
  for dir in "$1"/checkpoints/step_[0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9]; do
    [[ -f $dir/model.safetensors && -f $dir/trainer_state.pt && -f $dir/config.json ]] || continue
    found=$((10#${dir##*/step_}))
    if [[ -z $step ]] || ((found > step)); then
      step=$found path=$dir
    fi
  done
  [[ -z $step ]] || printf '%s %s\n' "$step" "$path"
}

# Exits 2, the contract's input error, with `$*` as the job's error: logged, and alone as the
# last line of the agent's stderr (no newline after it: read_trainer_status in launch.sh says
# why), which the supervisor quotes in its cause ("input error (status 2)" marks it).
# input_error <message>: the job and node rank come from TRAINIUM_JOB_ID and TRAINIUM_NODE_RANK
# ("?" before launch.sh knows them); the line goes to AGENT_ERR, the agent's own stderr, once
# launch.sh has sent its stderr to the agent's stdout.
input_error() {
  LAST_ERROR="$*"
  log "error: $*"
  printf 'job %s: input error (status 2) on node rank %s: %s' "${TRAINIUM_JOB_ID:-?}" \
    "${TRAINIUM_NODE_RANK:-?}" "$*" >&"${AGENT_ERR:-2}"
  PASS_STATUS=2
  exit 2
}

# What an exit status means, in a few words.
status_meaning() {
  local status=$1 signal
  if ((status == 194)); then
    echo "the SSM agent would take it as a request to reboot the instance"
  elif ((status == 168 || status == 169)); then
    echo "the SSM agent would end the document there with success or failure"
  elif ((status > 128)) && signal=$(kill -l "$((status - 128))" 2>/dev/null); then
    case $signal in
      KILL) echo "killed by SIGKILL: out of memory? the SSM agent would report a time-out" ;;
      *) echo "killed by SIG$signal" ;;
    esac
  else
    echo "not a status of the scripts' contract: 0, 1, 3, 4, 75"
  fi
}

# Runs one named phase and logs its duration: phase <name> <command> [args...]
# A failure inside the phase stops the script (set -e) and on_err names the phase.
CURRENT_PHASE=""
phase() {
  local name=$1 start
  shift
  start=$(date +%s)
  CURRENT_PHASE=$name
  log "phase $name: start"
  "$@"
  log "phase $name: done in $(($(date +%s) - start)) s"
  CURRENT_PHASE=""
}

# Puts the Neuron and EFA tool folders on PATH (where they exist) and gives HOME a value.
node_path() {
  local dir
  for dir in "$EFA_TOOLS_DIR" "$NEURON_TOOLS_DIR"; do
    if [[ -d $dir && ":$PATH:" != *":$dir:"* ]]; then
      PATH="$dir:$PATH"
    fi
  done
  export PATH HOME="${HOME:-/root}"
}
node_path

# Loads cluster.env (KEY=VALUE lines written by the instance user data) and node.env (written
# by bootstrap) when present.
load_cluster_env() {
  if [[ -f $ENV_FILE ]]; then
    set -a
    # shellcheck disable=SC1090  # the path is chosen at run time
    source "$ENV_FILE"
    if [[ -f $NODE_ENV_FILE ]]; then
      # shellcheck disable=SC1090
      source "$NODE_ENV_FILE"
    fi
    set +a
    return 0
  fi
  return 1
}

validate_job_id() {
  [[ $1 =~ $JOB_ID_PATTERN ]] ||
    die "--job-id '$1' is not allowed: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
}

validate_port() {
  if [[ ! $2 =~ ^[1-9][0-9]{0,4}$ ]] || (($2 > 65535)); then
    die "$1 '$2' is not a TCP port: use a number from 1 to 65535"
  fi
}

validate_nproc() {
  [[ $1 == auto || $1 =~ ^[1-9][0-9]{0,2}$ ]] ||
    die "--nproc-per-node '$1' is not allowed: use 'auto' (one process per NeuronCore) or a number from 1 to 999"
}

# Splits --hosts into the HOSTS array; rejects empty entries and duplicates.
parse_hosts() {
  local raw=$1 host seen=","
  [[ -n $raw ]] || die "--hosts is required: the comma-separated addresses of all nodes, master first"
  IFS=',' read -r -a HOSTS <<<"$raw"
  for host in "${HOSTS[@]}"; do
    [[ $host =~ $IPV4_PATTERN ]] ||
      die "--hosts entry '$host' is not an IPv4 address: give the nodes' private addresses, comma separated"
    [[ $seen != *",$host,"* ]] || die "--hosts lists $host twice: every node must appear once"
    seen+="$host,"
  done
}

# IPv4 addresses configured on this machine (or network namespace), one per line.
local_addresses() {
  if command -v ip >/dev/null 2>&1; then
    ip -o -4 addr show | awk '{split($4, a, "/"); print a[1]}'
  else
    hostname -I | tr ' ' '\n' | sed '/^$/d'
  fi
}

# Sets NODE_RANK and NODE_ADDRESS from HOSTS: the index of this node's own address,
# or of the explicit override in $1.
find_node_rank() {
  local override=${1:-} addresses i matches=()
  if [[ -n $override ]]; then
    for i in "${!HOSTS[@]}"; do
      if [[ ${HOSTS[i]} == "$override" ]]; then
        NODE_RANK=$i NODE_ADDRESS=$override
        return 0
      fi
    done
    die "--node-address $override is not in --hosts ${HOSTS[*]}"
  fi
  addresses=$(local_addresses)
  for i in "${!HOSTS[@]}"; do
    if grep -qxF "${HOSTS[i]}" <<<"$addresses"; then
      matches+=("$i")
    fi
  done
  if ((${#matches[@]} == 0)); then
    die "none of --hosts (${HOSTS[*]}) is an address of this node ($(echo "$addresses" | paste -sd, -)); pass --node-address"
  fi
  if ((${#matches[@]} > 1)); then
    die "several --hosts entries are addresses of this node; pass --node-address to choose one"
  fi
  NODE_RANK=${matches[0]}
  NODE_ADDRESS=${HOSTS[NODE_RANK]}
}

# Network interface that carries an address of this node ("lo" for other loopback
# addresses, which Linux answers on lo without listing them).
interface_of() {
  local dev
  command -v ip >/dev/null 2>&1 || return 0
  dev=$(ip -o -4 addr show | awk -v a="$1" '{split($4, p, "/"); if (p[1] == a) {print $2; exit}}')
  if [[ -z $dev && $1 == 127.* ]]; then
    dev=lo
  fi
  printf '%s' "$dev"
}

# Total NeuronCores reported by `neuron-ls -j` (0 when there is no Neuron device): one
# process per NeuronCore that the runtime exposes. On trn2 that is the logical NeuronCore:
# with the default logical NeuronCore configuration 2, a Trainium2 device's 8 physical cores
# are 4 logical ones, and neuron-ls -j already reports them so ("nc_count": 4,
# "logical_neuroncore_config": 2 per device on a trn2n.48xlarge in the Neuron LS User Guide,
# tools/neuron-sys-tools/neuron-ls.rst; 64 ranks per trn2.48xlarge in Neuron's training best
# practices): nc_count is not divided by logical_neuroncore_config again.
neuron_core_count() {
  { neuron-ls -j 2>/dev/null || true; } | python3 -c '
import json, sys
try:
    devices = json.load(sys.stdin)
except ValueError:
    devices = []
print(sum(int(d.get("nc_count", 0)) for d in devices if isinstance(d, dict)))
'
}

# EFA devices in `fi_info -p efa -t FI_EP_RDM` output (stdin): the distinct `domain:` values
# ending in -rdm in blocks of provider efa (libfabric prints one block per device: provider,
# fabric, domain (rdmap0s31-rdm), version, type, protocol).
efa_device_count() {
  awk '$1 == "provider:" {efa = ($2 == "efa")}
    efa && $1 == "domain:" && $2 ~ /-rdm$/ && !seen[$2]++ {n++}
    END {print n + 0}'
}

# Sets NPROC and ON_TRAINIUM from the requested --nproc-per-node value.
resolve_nproc() {
  local requested=$1 cores=0
  ON_TRAINIUM=0
  if command -v neuron-ls >/dev/null 2>&1; then
    cores=$(neuron_core_count)
    ((cores > 0)) && ON_TRAINIUM=1
  fi
  if [[ $requested == auto ]]; then
    command -v neuron-ls >/dev/null 2>&1 ||
      die "--nproc-per-node auto needs neuron-ls (a Trainium node); pass a number of processes per node on other machines"
    ((cores > 0)) || die "neuron-ls found no NeuronCores on this node: is the Neuron driver loaded? (see preflight)"
    NPROC=$cores
  else
    NPROC=$requested
    if ((ON_TRAINIUM && NPROC > cores)); then
      die "--nproc-per-node $NPROC exceeds the $cores NeuronCores of this node"
    fi
  fi
}

# Exports the environment of a multi-node job: EFA and Neuron runtime settings on
# Trainium, the rendezvous interface everywhere. Needs HOSTS, NODE_ADDRESS, MASTER_PORT,
# ON_TRAINIUM.
export_job_environment() {
  local iface
  iface=$(interface_of "$NODE_ADDRESS")
  if [[ -n $iface ]]; then
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$iface}"
  fi
  export MALLOC_ARENA_MAX="${MALLOC_ARENA_MAX:-64}"
  export PYTHONUNBUFFERED=1
  if ((ON_TRAINIUM)); then
    export FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1 FI_EFA_FORK_SAFE=1
    # The Neuron collectives' root communicator; it needs its own port next to torchrun's.
    export NEURON_RT_ROOT_COMM_ID="${HOSTS[0]}:$((MASTER_PORT + 1))"
    export NEURON_RT_STOCHASTIC_ROUNDING_EN="${NEURON_RT_STOCHASTIC_ROUNDING_EN:-1}"
    # Precision is train.py's --precision alone (torch autocast): the compiler must not
    # cast on top, and train.py refuses any --auto-cast but none. Override the whole
    # string through the environment or cluster.env.
    export NEURON_CC_FLAGS="${NEURON_CC_FLAGS:---model-type=transformer --auto-cast=none --optlevel=2}"
    # An interrupted or failed compile is cached as failed, and later runs skip it ("Got a
    # cached failed neff ... please set --retry_failed_compilation": Neuron persistent cache
    # documentation, about-neuron/arch/neuron-features/neuron-caching.rst). The stop path,
    # the leg timer and the OOM killer all interrupt neuronx-cc, and the cache on /fsx is
    # shared by every node and job: without the flag one interrupted compile fails every
    # later attempt of every job with that graph. Added to an overriding string too. The
    # cache's wrapper (neuron_cc_wrapper) reads it; it is not passed to the compiler.
    if [[ " $NEURON_CC_FLAGS " != *" --retry_failed_compilation "* ]]; then
      NEURON_CC_FLAGS+=" --retry_failed_compilation"
    fi
    # The shared Neuron persistent cache: a directory on /fsx (bootstrap.sh checks it is on
    # the mounted file system), which the file system links to the compile-cache bucket.
    if [[ -n ${COMPILE_CACHE_URL:-} ]]; then
      export NEURON_COMPILE_CACHE_URL="${NEURON_COMPILE_CACHE_URL:-$COMPILE_CACHE_URL}"
    fi
    if [[ -n $iface ]]; then
      export CCOM_SOCKET_IFNAME="${CCOM_SOCKET_IFNAME:-$iface}"
    fi
  else
    log "no NeuronCores on this node: EFA and Neuron runtime variables left unset"
  fi
}

# The Neuron compile cache's entries named by a failed compile in a job's log (stdin), one
# path per line: <cache>/neuronxcc-<version>/MODULE_<graph hash>+<flags hash>, which holds
# the graph (model.hlo_module.pb), compile_flags.json and, once compiled, model.neff (the
# layout in Neuron's persistent cache documentation and its profiling tutorial). A failed
# compile's lines name the entry by its path ("Got a cached failed neff at
# <entry>/model.neff", the runtime's "RunNeuronCCImpl: ... '<entry>/model.neff'") or by its
# module ("model.MODULE_<hash>+<flags>.hlo_module.pb"), which is looked up under <cache>.
# failed_compile_entries <cache-dir or URL>
failed_compile_entries() {
  local cache=${1%/} line module found
  # Lines that name a module and say fail or error outside their paths (a path may hold any
  # word): word by word (words end at a space or a quote), linear in a line's length. A
  # regular expression that matches the paths in place (gsub) scans the rest of the line from
  # each of its characters: a job that logs lines of 30,000 characters kept launch.sh busy
  # for a minute per 500 KB of log.
  awk 'index($0, "MODULE_") {
      n = split($0, words, /[ '"'"'"]/)
      for (i = 1; i <= n; i++) if (!index(words[i], "/") && tolower(words[i]) ~ /fail|error/) {print; next}
    }' |
    grep -oE '[^ '"'"'"]*MODULE_[0-9]+\+[0-9a-f]+' | sort -u | while read -r line; do
    module=$(grep -oE 'MODULE_[0-9]+\+[0-9a-f]+' <<<"$line")
    if [[ $line == */"$module"* ]]; then
      echo "${line%%"$module"*}$module"
    elif [[ -d $cache ]] && found=$(compgen -G "$cache/*/$module") && [[ -n $found ]]; then
      head -n 1 <<<"$found"
    else
      echo "$cache/<neuronxcc version>/$module"
    fi
  done | sort -u
}

# Open files: Run Command starts every script with a soft RLIMIT_NOFILE of 1024 (systemd's
# DefaultLimitNOFILE=1024:524288 for services, systemd-system.conf(5); the SSM agent's unit
# does not raise it, and Go >= 1.21, which builds the agent, restores the original soft
# limit in the processes it starts: Go CL 476097). A job needs more per process:
#   - gloo connects every pair of ranks of a group (a full mesh): one socket per peer, so
#     world - 1 in each process for a gloo group over all ranks, which the trainer has on
#     cpu and cuda (under xla it has a group per node and one of the nodes' leaders,
#     workload/backend.py NodeTree; preflight's collective check has one); measured with
#     torch 2.9: a 12-rank gloo group costs 13 descriptors per process, and in
#     tests/test_launch_scripts.py 1 per peer + 4 per group;
#   - torchrun on the master node serves the rendezvous TCPStore: one connection per rank;
#   - NOFILE_BASE for everything else (Python and its libraries, the Neuron runtime's device
#     files, logs, data loader pipes): the 1024 such a process is otherwise used to.
# So at least world + NOFILE_BASE: 32 x nodes + 1024 on trn1.32xlarge, past 1024 from the
# first multi-process job. raise_open_file_limit <needed> raises the soft limit to the hard
# limit (what neuronx-distributed's launch scripts do with `ulimit -n 65535`), and fails
# when even the hard limit is below <needed>.
NOFILE_BASE=1024
raise_open_file_limit() {
  local needed=$1 soft hard
  soft=$(ulimit -Sn)
  hard=$(ulimit -Hn)
  if [[ $hard != unlimited ]] && ((hard < needed)); then
    die "the open-file hard limit is $hard, below the $needed descriptors a process of this job may need (one per rank for gloo and the rendezvous store, + $NOFILE_BASE): raise LimitNOFILE of the amazon-ssm-agent unit"
  fi
  if [[ $soft != "$hard" ]]; then
    ulimit -Sn "$hard"
    log "open files: soft limit raised from $soft to $hard (this job needs about $needed)"
  fi
}

# Puts torchrun on PATH: the DLAMI's Neuron venv when present (and the workload's venv
# layered over it, when bootstrap made one), else whatever PATH has.
activate_python() {
  if [[ -n ${NEURON_VENV:-} && -f $NEURON_VENV/bin/activate ]]; then
    set +u
    # shellcheck disable=SC1091  # the DLAMI's venv exists only on the nodes
    source "$NEURON_VENV/bin/activate"
    set -u
  fi
  if [[ -n ${WORKLOAD_VENV:-} && -x $WORKLOAD_VENV/bin/python ]]; then
    PATH="$WORKLOAD_VENV/bin:$PATH"
  fi
  command -v torchrun >/dev/null 2>&1 ||
    die "torchrun not found: set NEURON_VENV to the Neuron venv or put a Python environment with torch on PATH"
}

# Fails when this is a configured cluster node whose bootstrap has not finished.
require_ready() {
  if [[ -f $ENV_FILE && ! -f $READY_MARKER ]]; then
    die "this node is not ready: bootstrap has not finished (no $READY_MARKER; see $LOG_DIR/bootstrap.log)"
  fi
}

# Process IDs on this machine that belong to a job: launch.sh tags every process it starts
# with TRAINIUM_JOB_ID (and TRAINIUM_NODE_ADDRESS, TRAINIUM_LEG, TRAINIUM_STATE_DIR) in its
# environment, which survives re-parenting when a launcher dies and new sessions (torchrun
# starts each worker with start_new_session=True). job_pids <job-id|*> [node-address] [leg];
# "*" matches any job. Only processes tagged with this node's state directory count: on a
# cluster node that is always /var/lib/trainium-cluster, and where several simulated nodes
# share one machine and one address (the tests, a loopback rehearsal, two test runs side by
# side), each has its own, so stopping one node's leftovers never ends another's job. Zombies
# and processes in other network namespaces (other rehearsal nodes) are left out. Python, not
# grep: a process in the middle of an exec reads as untagged to a scan that reads each
# environment once, and grep's and sed's reads can be cut short by the exec (job_processes.py).
job_pids() {
  local job=$1 node=${2:-} leg=${3:-} caller=$BASHPID
  # Untagged (as untagged_sleep), so that it never takes itself for one of the job's.
  (
    unset "${JOB_TAGS[@]}"
    exec python3 -I -S "$NODE_DIR/job_processes.py" --job "$job" --state-dir "$STATE_DIR" \
      ${node:+--node "$node"} ${leg:+--leg "$leg"} --exclude "$$" --exclude "$caller"
  )
}

# Whether a process is still running (not gone, not a zombie waiting for its parent).
running() {
  local state
  state=$(awk '{sub(/^.*\) /, ""); print $1}' "/proc/$1/stat" 2>/dev/null || true)
  [[ -n $state && $state != Z ]]
}

# Parent PID of a process (field 4 of /proc/<pid>/stat).
parent_pid() {
  awk '{sub(/^.*\) /, ""); print $2}' "/proc/$1/stat" 2>/dev/null || true
}

# Whether a process is torchrun (the elastic agent): its command line runs the torchrun
# console script or `python -m torch.distributed.run`.
is_torchrun() {
  local words
  words=$(head -c 4096 "/proc/$1/cmdline" 2>/dev/null | tr '\0' '\n' | head -n 3 || true)
  grep -qE '(^|/)torchrun$|^torch\.distributed\.(run|launch)$' <<<"$words"
}

# The torchrun processes among <pids>.
job_torchruns() {
  local pid
  for pid in $1; do
    if is_torchrun "$pid"; then echo "$pid"; fi
  done
}

# The processes among <pids> to stop first: the workers. That is every one that is not
# torchrun and whose parent is torchrun or no process of the job (a worker left by a dead
# torchrun, a job started without torchrun); a worker's own children (data loaders, the
# compiler) are left to the worker, whose SIGTERM handler may still need them to save.
job_workers() {
  local pid parent
  for pid in $1; do
    is_torchrun "$pid" && continue
    parent=$(parent_pid "$pid")
    if [[ -n $parent && " ${1//$'\n'/ } " == *" $parent "* ]] && ! is_torchrun "$parent"; then
      continue
    fi
    echo "$pid"
  done
}

# Waits until none of <pids> runs or SECONDS reaches <deadline>; fails on the deadline. It looks
# again after 0.05 s, then 0.1, 0.2, 0.5 and every second: processes that end at once on a
# SIGTERM are seen gone within a tenth of a second (a stop has two or three such waits), and
# a save that takes minutes is looked at once a second.
wait_until_ended() {
  local pids=$1 deadline=$2 pid left pause=0.05
  while true; do
    left=""
    for pid in $pids; do
      if running "$pid"; then left+="$pid "; fi
    done
    pids=$left
    [[ -z $pids ]] && return 0
    ((SECONDS < deadline)) || return 1
    untagged_sleep "$pause"
    case $pause in
      0.05) pause=0.1 ;;
      0.1) pause=0.2 ;;
      0.2) pause=0.5 ;;
      *) pause=1 ;;
    esac
  done
}

# Stops a job's processes within <grace> seconds: SIGTERM to the workers first, then, once
# they have ended, to what is left (torchrun), then SIGKILL to whatever still runs when the
# grace is over. Not all at once: torch 2.9's torchrun answers a SIGTERM by passing it on to
# its workers and SIGKILLing them 30 s later whatever the grace
# (torch/distributed/elastic/multiprocessing/api.py, SubprocessContext._close(death_sig,
# timeout=30), line 903 in the installed torch 2.9.0), which would cut a longer checkpoint
# save short. torchrun ends by itself once all its workers have exited 0.
# stop_job <job-id|*> <grace-seconds> [node-address] [leg]; fails when nothing was running.
stop_job() {
  local job=$1 grace=$2 node=${3:-} leg=${4:-} pids workers deadline
  pids=$(job_pids "$job" "$node" "$leg")
  if [[ -z $pids ]]; then
    return 1
  fi
  deadline=$((SECONDS + grace))
  workers=$(job_workers "$pids")
  if [[ -n $workers ]]; then
    log "sending SIGTERM to $(wc -w <<<"$workers") worker processes of job $job: $(paste -sd' ' <<<"$workers")"
    # shellcheck disable=SC2086  # one PID per word
    kill -TERM $workers 2>/dev/null || true
    wait_until_ended "$workers" "$deadline" || true
    # torchrun exits by itself once its workers have: it looks within its monitor interval
    # (0.1 s by default), but on a loaded machine it has taken more than 5 s to get there, and
    # a SIGTERM to it then made its status 143 and a clean stop a failed leg. So it gets what
    # is left of the grace; the job's other processes (a worker's children) are not waited for.
    wait_until_ended "$(job_torchruns "$(job_pids "$job" "$node" "$leg")")" "$deadline" || true
  fi
  pids=$(job_pids "$job" "$node" "$leg")
  if [[ -n $pids ]] && ((SECONDS < deadline)); then
    log "sending SIGTERM to $(wc -w <<<"$pids") remaining processes of job $job: $(paste -sd' ' <<<"$pids")"
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    wait_until_ended "$pids" "$deadline" || true
  fi
  pids=$(job_pids "$job" "$node" "$leg")
  if [[ -n $pids ]]; then
    log "sending SIGKILL to processes still running after ${grace} s: $(paste -sd' ' <<<"$pids")"
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
  fi
  return 0
}

# Start time of a process (field 22 of /proc/<pid>/stat, proc(5)), to tell it from a later one
# that reuses its PID; empty when there is no such process. Bash alone, no other process: the
# fields after the command name, which ends at the last ") " (a name may hold spaces and
# parentheses), from field 3 on.
process_start_time() {
  local stat fields
  read -r stat 2>/dev/null <"/proc/$1/stat" || return 0
  read -ra fields <<<"${stat##*) }"
  printf '%s\n' "${fields[19]}"
}

# Whether process <pid> is still the one that started at <start> (process_start_time), without
# starting a process: the leg watchdog asks every second for as long as a leg runs.
# still_running <pid> <start>
still_running() {
  local stat fields
  read -r stat 2>/dev/null <"/proc/$1/stat" || return 1
  read -ra fields <<<"${stat##*) }"
  [[ ${fields[19]} == "$2" ]]
}

# Whether process <pid> is still the one that started at <start> and has not ended: as
# still_running, and not a zombie. A launcher killed by SIGKILL stays a zombie, listed in /proc
# with its start time, until its parent reaps it: the SSM agent does at once, a parent that
# does not wait (a shell or container without a reaping init) may never. What it started goes
# on without it all that time, so the leg watchdog takes a zombie for gone.
# still_alive <pid> <start>
still_alive() {
  local stat fields
  read -r stat 2>/dev/null <"/proc/$1/stat" || return 1
  read -ra fields <<<"${stat##*) }"
  [[ ${fields[0]} != [ZX] && ${fields[19]} == "$2" ]]
}

# Returns once <pid>, a background child of this shell, has ended and bash has reaped it,
# without the `wait` builtin: when a trapped signal interrupts `wait` as a child ends, bash
# can lose that child's status (a later `wait` for it returns -1, or 128 + the signal's
# number), whichever child the interrupted `wait` was waiting for (measured with bash 5.2.15;
# the DLAMI's Ubuntu 24.04 ships bash 5.2; tests/test_node_wait.py). In launch.sh, end_leg's
# recheck USR1 turned a leg that ended at its time limit into a failure that way ("torchrun ended with status 138
# (killed by SIGUSR1)"). So this polls: still_running until bash has reaped the child (it
# does as the SIGCHLD comes, and keeps the status for a later `wait`), with a `sleep <poll>`
# in the foreground between looks. A trap waits for a foreground command to end (bash(1),
# SIGNALS), so a trap runs whole, between two looks. Not `read -t` on a pipe, as the leg
# watchdog waits (no traps there): a trap runs inside `read`, and read's time-out ends the
# trap where it is (end_leg stopped half-way, its recheck never sent). The caller then reads
# the status with `wait` while it ignores the signals it traps.
# wait_until_reaped <pid> <poll-seconds>
wait_until_reaped() {
  local pid=$1 poll=$2 stat fields
  read -r stat 2>/dev/null <"/proc/$pid/stat" || return 0
  read -ra fields <<<"${stat##*) }"
  while still_running "$pid" "${fields[19]}"; do
    untagged_sleep "$poll" || :
  done
}

# `sleep <seconds>` that is not one of the job's processes. launch.sh sleeps beside its job
# (wait_until_reaped's polls, the leg timer, end_leg's recheck, stopping leftovers), and a
# stop_job elsewhere on the node (stop.sh) must not take such a sleep for a leftover of the
# job: it logged "sending SIGTERM to 1 remaining processes" for a clean stop, and killed it.
# Untagged from its first exec on: the subshell holds the script's own environment, which the
# tags are not part of (they are exported, not exec'd with; /proc/<pid>/environ is what a
# process was exec'd with), and execs sleep without them. Still one process, as `sleep` was.
untagged_sleep() {
  (
    unset "${JOB_TAGS[@]}"
    exec sleep "$1"
  )
}

# Ends a leg's processes when the script that started them dies, however it dies. The SSM
# agent ends a cancelled or timed-out command with SIGKILL to the script's process group
# (aws/amazon-ssm-agent agent/executers/executers_unix.go killProcess): no trap runs, and
# torchrun's workers live in sessions of their own (start_new_session=True), so without
# this they would keep the NeuronCores and go on training. The watchdog runs in a session
# of its own, untagged, polls the script every second, and then stops the leg's processes
# (SIGTERM, <grace> seconds, SIGKILL). It waits its second in `read -t 1` on a pipe that never
# has data, and asks still_alive: no process started a second (a `sleep 1` and a command
# substitution running awk did: about 2,000 of each in one run of the test suite).
# start_leg_watchdog <job-id> <node-address> <leg> <grace>
start_leg_watchdog() {
  local job=$1 node=$2 leg=$3 grace=$4 parent=$$ started
  started=$(process_start_time "$parent")
  # Untagged from its first exec on (as the job's tee in launch.sh): a stop_job elsewhere on
  # the node must never take the watchdog for a worker of the job.
  # shellcheck disable=SC2016  # the inner script expands its own positional arguments
  (
    unset "${JOB_TAGS[@]}"
    TRAINIUM_WATCHDOG=1 exec setsid bash -c '
      source "$1"
      SCRIPT_NAME=watchdog
      exec {tick}<> <(:)
      while still_alive "$2" "$3"; do read -r -t 1 -u "$tick" _ || :; done
      if stop_job "$4" "$7" "$5" "$6"; then
        log "launcher of job $4 (leg $6) is gone: stopped the processes it left"
      fi' watchdog "$NODE_DIR/lib.sh" "$parent" "$started" "$job" "$node" "$leg" "$grace"
  ) </dev/null >>"${WATCHDOG_LOG:-/dev/null}" 2>&1 &
}
