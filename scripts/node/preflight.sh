#!/usr/bin/env bash
# Checks that this node is fit for a long multi-node job, then proves that all nodes can
# run a collective together.
#
#   preflight.sh --hosts IP1,IP2,... [--port 29600] [--nproc-per-node auto|N]
#                [--jobs-root /fsx/jobs] [--node-address ADDR] [--min-free-gb 50]
#                [--wait-ready 900]
#
# Local checks: bootstrap finished (waits up to --wait-ready seconds), Neuron devices and driver
# healthy and idle, no Neuron hardware errors in the kernel log, the Neuron release's versions
# within the range that trains (neuron_release.py), EFA provider present with the EFA_DEVICE_COUNT
# devices of the instance type (multi-node), FSx mounted and the jobs root writable, enough free
# disk on / and on TMPDIR, the open-file limit raised to the hard limit (which must cover nodes x
# processes + 1024), a local nccom-test all-reduce over this node's NeuronCores where the Neuron
# tools are installed (its output is read too: its exit status on a failed check is not
# documented). Then the nodes agree (agreement.py, one process per node, one connection each to
# the first host at --port + 2): every node says whether its local checks passed and which
# software it runs (the node-software triple bootstrap recorded, and the versions of its Neuron
# release: torch-neuronx, neuronx-cc, libneuronxla, runtime, driver); a node that failed, a node
# that never reports (within --wait-ready + 180 s) and a mixed fleet stop every node at once,
# without an all-reduce. Otherwise every node runs collective_check.py under torchrun with the
# training environment (an all-reduce over all NeuronCores of all nodes: Neuron collectives over
# EFA on Trainium, gloo elsewhere), bounded by 480 s. (A cross-node nccom-test starts its remote
# ranks with MPI over SSH, which the nodes do not have: the torch all-reduce is the cross-node
# check.) Prints one PASS/FAIL line per check and one `node-software:` line (the software version,
# launch template version and AMI that bootstrap recorded; PASS/FAIL node-software: nodes that
# differ must be rolled, `cluster.py roll`). Exits 1 when any check fails; 3 when the node should
# be replaced: bootstrap failed on this boot (its marker $STATE_DIR/failed), a Neuron hardware
# error, Neuron software outside the supported range, fewer EFA devices than EFA_DEVICE_COUNT (one
# line names the reasons); 4 when the nodes run different software (no retry helps: the fleet
# needs a roll; the job supervisor ends the job on it). 3 wins over 4: a broken node is replaced
# either way.
# --min-free-gb defaults to PREFLIGHT_MIN_FREE_GB from cluster.env, else 50.
set -Eeuo pipefail
# shellcheck source=scripts/node/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
trap 'on_err $LINENO "$BASH_COMMAND"' ERR

load_cluster_env || true

hosts_arg="" port=29600 nproc_arg="" node_address_arg="" wait_ready=900
min_free_gb="${PREFLIGHT_MIN_FREE_GB:-50}"
jobs_root="${FSX_MOUNT_POINT:-/fsx}/jobs"
while (($#)); do
  case $1 in
    --hosts | --port | --nproc-per-node | --jobs-root | --node-address | --min-free-gb | --wait-ready)
      (($# >= 2)) || die "$1 needs a value (see --help)"
      case $1 in
        --hosts) hosts_arg=$2 ;;
        --port) port=$2 ;;
        --nproc-per-node) nproc_arg=$2 ;;
        --jobs-root) jobs_root=$2 ;;
        --node-address) node_address_arg=$2 ;;
        --min-free-gb) min_free_gb=$2 ;;
        --wait-ready) wait_ready=$2 ;;
      esac
      shift 2
      ;;
    -h | --help) usage && exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

validate_port --port "$port"
((port <= 65533)) ||
  die "--port $port leaves no ports for the Neuron root communicator (port + 1) and the nodes' agreement (port + 2): use at most 65533"
[[ $min_free_gb =~ ^[0-9]+$ ]] || die "--min-free-gb '$min_free_gb' is not a whole number of GiB"
[[ $wait_ready =~ ^[0-9]+$ ]] || die "--wait-ready '$wait_ready' is not a number of seconds"
parse_hosts "$hosts_arg"
find_node_rank "$node_address_arg"

failures=() replace_reasons=() mixed_fleet=0
pass() { log "PASS $1: $2"; }
fail() {
  log "FAIL $1: $2"
  failures+=("$1")
}
# A fault no retry on this node can fix: preflight exits 3, on which the job supervisor
# replaces the node.
replace() { replace_reasons+=("$1"); }
# Written by bootstrap.sh when it fails ("<time> <error>"), removed when it starts again.
BOOTSTRAP_FAILED_MARKER="$STATE_DIR/failed"

# The job's temporary files go to TMPDIR (node.env: bootstrap puts it on the scratch volume of
# an instance type with instance store), and check_storage checks its free space. One that is
# not a writable folder fails that check; preflight's own temporary files go to /tmp meanwhile.
tmpdir_unusable=""
if [[ -n ${TMPDIR:-} ]] && ! [[ -d $TMPDIR && -w $TMPDIR ]]; then
  tmpdir_unusable=$TMPDIR
  export TMPDIR=/tmp
fi

# The instance type says whether this node must have Neuron devices and EFA.
expect_trainium=0
[[ ${INSTANCE_TYPE:-} == trn* ]] && expect_trainium=1

check_ready() {
  local waited=0
  if [[ ! -f $ENV_FILE ]]; then
    pass ready "no $ENV_FILE: not a cluster node, nothing to wait for"
    return
  fi
  while [[ ! -f $READY_MARKER && ! -f $BOOTSTRAP_FAILED_MARKER ]] && ((waited < wait_ready)); do
    sleep 10
    waited=$((waited + 10))
  done
  if [[ -f $READY_MARKER ]]; then
    pass ready "bootstrap finished ($(head -n 1 "$READY_MARKER"))"
  elif [[ -f $BOOTSTRAP_FAILED_MARKER ]]; then
    # Bootstrap runs on every boot; one that failed on a later boot has no launch left to
    # abandon, and the group's EC2 status checks still pass: replace the node (bootstrap also
    # marks it Unhealthy in its group; this covers a node where that call failed).
    fail ready "bootstrap failed: $(head -n 1 "$BOOTSTRAP_FAILED_MARKER") (see $LOG_DIR/bootstrap.log)"
    replace "bootstrap failed on this boot: $(head -n 1 "$BOOTSTRAP_FAILED_MARKER" | cut -d' ' -f2-)"
  else
    fail ready "bootstrap has not finished after ${wait_ready} s (no $READY_MARKER; see $LOG_DIR/bootstrap.log)"
  fi
}

check_neuron() {
  local json devices cores busy
  if ! command -v neuron-ls >/dev/null 2>&1; then
    if ((expect_trainium)); then
      fail neuron "neuron-ls not found on a ${INSTANCE_TYPE} node: the Neuron tools are missing"
    else
      pass neuron "no Neuron tools and INSTANCE_TYPE '${INSTANCE_TYPE:-unset}' needs none"
    fi
    return
  fi
  if ! grep -q '^neuron ' < <(lsmod 2>/dev/null || true); then
    fail neuron-driver "the neuron kernel module is not loaded (modprobe neuron; check the aws-neuronx-dkms package)"
  else
    pass neuron-driver "neuron module loaded (version $(cat "${TRAINIUM_SYS_MODULE:-/sys/module}/neuron/version" 2>/dev/null || echo unknown))"
  fi
  # stdout only: neuron-ls prints its warnings on stderr, which would break the JSON.
  local errors
  errors=$(mktemp)
  if ! json=$(neuron-ls -j 2>"$errors"); then
    fail neuron "neuron-ls failed: $(head -n 3 "$errors" | paste -sd' ' -)"
    rm -f "$errors"
    return
  fi
  rm -f "$errors"
  read -r devices cores busy < <(python3 -c '
import json, sys
try:
    devices = json.loads(sys.argv[1] or "[]")
except ValueError:
    devices = []
cores = sum(int(d.get("nc_count", 0)) for d in devices)
busy = sorted({str(p.get("pid", "?")) for d in devices for p in d.get("neuron_processes") or []})
print(len(devices), cores, ",".join(busy) or "-")
' "$json")
  if ((devices == 0 || cores == 0)); then
    fail neuron "neuron-ls lists $devices devices with $cores NeuronCores"
  elif [[ $busy != - ]]; then
    fail neuron "NeuronCores are in use by processes $busy (a job still running? stop it with StopTraining)"
  else
    pass neuron "$devices Neuron devices, $cores NeuronCores, all idle"
  fi
  if grep -q 'NEURON_HW_ERR' < <(dmesg 2>/dev/null || true); then
    fail neuron-hardware "kernel log reports NEURON_HW_ERR: $(dmesg | grep 'NEURON_HW_ERR' | tail -n 1)"
    replace "it reports a Neuron hardware error"
  else
    pass neuron-hardware "no NEURON_HW_ERR in the kernel log"
  fi
}

# The node's Neuron release (neuron_release.py): torch-neuronx, neuronx-cc and libneuronxla in
# the Neuron venv, the runtime package and the loaded driver. On a Trainium node they must lie
# within the releases that train with PyTorch/XLA (neuron_releases.json): bootstrap refuses an
# image outside them, so a node that passed bootstrap and is outside them now had its software
# changed since, and a new node from the image is the fix (exit 3). Checked only once bootstrap
# has finished and the Neuron checks passed: before that the driver may not be loaded yet, and a
# failed check has said what is wrong. The agreement compares the versions across the nodes
# (NEURON_SOFTWARE).
neuron_software=unknown
check_neuron_release() {
  local verdict
  neuron_software=$(python3 "$NODE_DIR/neuron_release.py" versions --venv "${NEURON_VENV:-/nonexistent}" 2>/dev/null) ||
    neuron_software=unknown
  ((expect_trainium && ${#failures[@]} == 0)) || return 0
  if verdict=$(python3 "$NODE_DIR/neuron_release.py" check --venv "${NEURON_VENV:-/nonexistent}" 2>&1); then
    pass neuron-release "$verdict"
  else
    fail neuron-release "$(head -n 1 <<<"$verdict")"
    replace "its Neuron software is outside the supported range"
  fi
}

check_efa() {
  local providers found expected=${EFA_DEVICE_COUNT:-}
  if ((${#HOSTS[@]} == 1)); then
    pass efa "single node: EFA not needed"
    return
  fi
  if ! command -v fi_info >/dev/null 2>&1; then
    if ((expect_trainium)); then
      fail efa "fi_info not found: the EFA software (libfabric) is not installed"
    else
      pass efa "no libfabric and INSTANCE_TYPE '${INSTANCE_TYPE:-unset}' needs none (TCP)"
    fi
    return
  fi
  if ! providers=$(fi_info -p efa -t FI_EP_RDM 2>&1) || ! grep -q 'provider: efa' <<<"$providers"; then
    fail efa "fi_info -p efa found no EFA provider: check the EFA interfaces and the efa driver"
    return
  fi
  found=$(efa_device_count <<<"$providers")
  if [[ -z $expected ]]; then
    pass efa "libfabric EFA provider present, $found EFA devices (no EFA_DEVICE_COUNT in $ENV_FILE to compare with)"
  elif [[ ! $expected =~ ^[0-9]+$ ]]; then
    fail efa "EFA_DEVICE_COUNT '$expected' in $ENV_FILE is not a number of devices"
  elif ((found < expected)); then
    # A lost EFA device trains at a fraction of the bandwidth, silently: a hardware fault.
    fail efa "found $found EFA devices, expected $expected (${INSTANCE_TYPE:-this instance type}): a lost EFA device"
    replace "found $found of its $expected EFA devices"
  else
    pass efa "$found EFA devices, $expected expected"
  fi
}

check_storage() {
  local probe free_kb mount
  if [[ -n ${FSX_DNS_NAME:-} ]]; then
    mount=${FSX_MOUNT_POINT:-/fsx}
    if mountpoint -q "$mount"; then
      pass fsx "$mount is mounted"
    else
      fail fsx "$mount is not mounted (FSx for Lustre $FSX_DNS_NAME)"
    fi
  fi
  probe="$jobs_root/.preflight-$NODE_ADDRESS-$$"
  if mkdir -p "$jobs_root" 2>/dev/null && echo ok >"$probe" 2>/dev/null && [[ $(cat "$probe") == ok ]]; then
    rm -f "$probe"
    pass jobs-root "$jobs_root is writable"
  else
    rm -f "$probe" 2>/dev/null || true
    fail jobs-root "cannot write to $jobs_root"
  fi
  # The job's temporary files (the Neuron compiler's work directories among them) go to
  # TMPDIR: on an instance type with instance store bootstrap puts it on the scratch volume
  # (node.env, phase_scratch), elsewhere it is /tmp on the root volume.
  if [[ -n $tmpdir_unusable ]]; then
    fail disk "TMPDIR $tmpdir_unusable (node.env) is not a writable folder: the job's temporary files cannot go there"
  fi
  for path in / "${TMPDIR:-/tmp}"; do
    if ! free_kb=$(df -Pk "$path" 2>/dev/null | awk 'NR == 2 {print $4}') || [[ ! $free_kb =~ ^[0-9]+$ ]]; then
      fail disk "cannot read the free space of $path (df -Pk)"
    elif ((free_kb / 1048576 >= min_free_gb)); then
      pass disk "$path has $((free_kb / 1048576)) GiB free"
    else
      fail disk "$path has $((free_kb / 1048576)) GiB free, less than --min-free-gb $min_free_gb"
    fi
  done
}

check_nccom() {
  local cores output status=0 errors
  command -v nccom-test >/dev/null 2>&1 && ((ON_TRAINIUM)) || return 0
  cores=$(neuron_core_count)
  # A small all-reduce over this node's NeuronCores, with result checking. The operation
  # comes first (NCCOM-TEST user guide: nccom-test <operation> [options]).
  # Its exit status on a failed check is not documented: its output is the verdict too
  # ("errors found" from --check, "test failed"; a count of 0 errors is no failure).
  output=$(nccom-test allr -r "$cores" -b 8 -e 1MB -f 8 -n 5 -w 2 -d fp32 --check 2>&1) || status=$?
  errors=$(grep -iE 'errors? found|test failed' <<<"$output" | grep -viE '(^|[^0-9])0 errors? found' |
    head -n 2 | paste -sd' ' - || true)
  if ((status == 0)) && [[ -z $errors ]]; then
    pass nccom-local "$(grep -i 'avg bus bandwidth' <<<"$output" || echo "all-reduce over $cores NeuronCores")"
  else
    fail nccom-local "nccom-test all-reduce over $cores NeuronCores failed (status $status${errors:+, $errors}): $(tail -n 2 <<<"$output" | paste -sd' ' -)"
  fi
}

# Run Command starts scripts with a soft open-file limit of 1024 (systemd's default; see
# raise_open_file_limit in lib.sh). The all-reduce's rendezvous store on the first node takes a
# connection per rank, gloo (off Trainium) a socket per peer, and the agreement's first node one
# per node: raise the soft limit to the hard one, and fail this check when even that is too low.
check_open_files() {
  local needed=$((${#HOSTS[@]} * NPROC + NOFILE_BASE))
  if ! (raise_open_file_limit "$needed") >/dev/null 2>&1; then
    fail open-files "the open-file hard limit is $(ulimit -Hn), below the $needed descriptors the collective check may need (${#HOSTS[@]} nodes x $NPROC processes + $NOFILE_BASE): raise LimitNOFILE of the amazon-ssm-agent unit"
    return
  fi
  raise_open_file_limit "$needed" 2>/dev/null
  pass open-files "soft limit $(ulimit -Sn), about $needed needed"
}

# Seconds a node waits for the others in the agreement: they may still be waiting for their
# bootstrap (--wait-ready) and running their local checks.
AGREEMENT_MARGIN=180
# Bound on the all-reduce (torchrun's own static rendezvous waits 600 s, the gloo group 300 s).
# With the agreement's wait this stays within the Preflight document's 1800 s.
COLLECTIVE_LIMIT=480

# Every node first takes part in the agreement (agreement.py, one process per node, one
# connection each to the first host at --port + 2), local failures or not: a node that failed
# its local checks says so there, and every node then skips the all-reduce at once instead of
# waiting for a broken peer until the rendezvous times out. The agreement also compares the
# nodes' software (the node-software triple, passed in explicitly: node.env is exported only
# where cluster.env exists; and the Neuron release's versions) and refuses a mixed fleet with
# one `FAIL node-software:` line naming the nodes; the supervisor sees only exit codes, so
# the nodes must decide. That failure exits 4 (not 3: no node needs replacing, the fleet needs a roll; not 1: a retry on the same
# nodes would fail the same way). Only when every node passed everything do the nodes run
# the all-reduce under torchrun, bounded by COLLECTIVE_LIMIT seconds.
check_collective() {
  local output status=0 software verdict
  # activate_python dies (exits) when torchrun is missing: try it in a subshell first. Such a
  # node still takes part in the agreement, which needs only the standard library's python3,
  # so that the others learn at once that it cannot join the all-reduce, not at the timeout.
  if ! (activate_python) >/dev/null 2>&1; then
    fail collective "torchrun not found (NEURON_VENV=${NEURON_VENV:-unset}): this node cannot join the all-reduce"
  fi
  output=$(
    cd "$NODE_DIR"
    SOFTWARE_VERSION="${SOFTWARE_VERSION:-unknown}" \
      LAUNCH_TEMPLATE_VERSION="${LAUNCH_TEMPLATE_VERSION:-unknown}" AMI_ID="${AMI_ID:-unknown}" \
      NEURON_SOFTWARE="$neuron_software" python3 agreement.py --master-addr "${HOSTS[0]}" --port $((port + 2)) \
      --node-rank "$NODE_RANK" --nodes "${#HOSTS[@]}" --node-address "$NODE_ADDRESS" \
      --failures "${failures[*]}" --timeout $((wait_ready + AGREEMENT_MARGIN)) 2>&1
  ) || status=$?
  software=$(grep -m 1 -E '^(PASS|FAIL) node-software: ' <<<"$output" || true)
  case $software in
    PASS*) pass node-software "${software#PASS node-software: }" ;;
    FAIL*)
      # No all-reduce runs on a mixed fleet: no collective verdict to give.
      fail node-software "${software#FAIL node-software: }"
      mixed_fleet=1
      return
      ;;
  esac
  verdict=$(grep -m 1 '^FAIL collective: ' <<<"$output" || true)
  if [[ -n $verdict ]]; then
    fail collective "${verdict#FAIL collective: }"
    return
  elif ((status != 0)); then
    fail collective "the agreement with the other nodes failed (status $status): $(tail -n 3 <<<"$output" | paste -sd' ' -)"
    return
  fi
  if ((${#failures[@]})); then
    log "collective: not run: this node failed its local checks (${failures[*]}); the other nodes know"
    return
  fi
  activate_python
  status=0
  output=$(
    cd "$NODE_DIR"
    TRAINIUM_JOB_ID="preflight" TRAINIUM_NODE_ADDRESS="$NODE_ADDRESS" TRAINIUM_STATE_DIR="$STATE_DIR" \
      timeout --kill-after=60 "$COLLECTIVE_LIMIT" \
      torchrun --nnodes "${#HOSTS[@]}" --node_rank "$NODE_RANK" --master_addr "${HOSTS[0]}" \
      --master_port "$port" --nproc_per_node "$NPROC" collective_check.py --size-mb 16 2>&1
  ) || status=$?
  if ((status == 0)); then
    pass collective "all-reduce across ${#HOSTS[@]} nodes x $NPROC processes: $(grep '"event": "collective"' <<<"$output" || echo ok)"
  elif ((status == 124 || status == 137)); then
    fail collective "all-reduce across ${#HOSTS[@]} nodes did not end within $COLLECTIVE_LIMIT s: $(tail -n 3 <<<"$output" | paste -sd' ' -)"
  else
    fail collective "all-reduce across ${#HOSTS[@]} nodes failed (status $status): $(tail -n 5 <<<"$output" | paste -sd' ' -)"
  fi
}

log "preflight on node rank $NODE_RANK of ${#HOSTS[@]} ($NODE_ADDRESS)"
# First on stdout, so that it is within the part of the output SSM keeps and shows.
echo "node-software: version=${SOFTWARE_VERSION:-unknown} launch-template-version=${LAUNCH_TEMPLATE_VERSION:-unknown} ami=${AMI_ID:-unknown}"
check_ready
check_neuron
check_neuron_release
if [[ -z $nproc_arg ]]; then
  if command -v neuron-ls >/dev/null 2>&1; then nproc_arg=auto; else nproc_arg=1; fi
fi
validate_nproc "$nproc_arg"
if ((${#failures[@]} == 0)); then
  resolve_nproc "$nproc_arg"
else
  ON_TRAINIUM=0 NPROC=1
fi
check_efa
check_storage
check_nccom
check_open_files
# shellcheck disable=SC2034  # read by export_job_environment
MASTER_PORT=$port
export_job_environment
# Every node joins the agreement even after a local failure, so that the others do not wait
# for it until their rendezvous times out.
check_collective

if ((${#failures[@]})); then
  log "preflight FAILED on $NODE_ADDRESS: ${failures[*]}"
  if ((${#replace_reasons[@]})); then
    reasons=$(printf '%s; ' "${replace_reasons[@]}")
    log "replace this node: ${reasons%; }"
    exit 3
  fi
  if ((mixed_fleet)); then
    log "roll the fleet: the nodes run different software (python scripts/cluster.py roll --wait)"
    exit 4
  fi
  exit 1
fi
log "preflight passed on $NODE_ADDRESS"
