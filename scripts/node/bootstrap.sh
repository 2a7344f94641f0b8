#!/usr/bin/env bash
# Prepares a cluster node for training, on every boot. The instance user data runs it the
# first time, after unpacking /opt/trainium-cluster and writing cluster.env; it installs the
# systemd unit trainium-bootstrap.service, which runs it on every later boot.
#
#   bootstrap.sh [--env-file /etc/trainium-cluster/cluster.env]
#
# Phases, each logged with its duration to /var/log/trainium-cluster/bootstrap.log:
#   environment     read and check cluster.env
#   identity        instance, AMI, Auto Scaling group and launch template version (IMDSv2,
#                   then autoscaling:DescribeAutoScalingInstances); writes node.env; while a
#                   launch lifecycle action is pending, records a heartbeat every 10 minutes
#   boot-unit       trainium-bootstrap.service (every boot, after network-online.target) and
#                   a tmpfiles.d rule that clears the previous boot's ready/failed markers
#   scratch         instance-store NVMe: RAID 0 over all of them (or the one), ext4, mounted
#                   at SCRATCH_DIR; TMPDIR for jobs and the Neuron compiler goes there
#   fsx             Lustre client for the running kernel, fstab entry, /fsx mounted
#   neuron          Neuron driver loaded, NeuronCores visible (neuron-ls), and the image's
#                   Neuron release one that trains with PyTorch/XLA: neuron_release.py
#                   reads torch-neuronx, neuronx-cc, libneuronxla, the runtime and the driver
#                   and refuses, in one line, versions outside neuron_releases.json's range
#   efa             libfabric EFA provider present with EFA_DEVICE_COUNT devices (multi-node
#                   clusters; fewer is a hardware fault: the node is replaced)
#   python          the workload venv layered on the Neuron venv (see requirements_diff.py):
#                   the reference workload's requirements (workload-requirements.txt beside
#                   this script, a copy of workload/requirements.txt), only what the Neuron
#                   venv lacks, never over its packages. Jobs run in it; their code is no
#                   node software (it comes with each job as a snapshot: launch.sh)
#   compile-cache   point the Neuron persistent compile cache at COMPILE_CACHE_URL, a directory
#                   on the mounted /fsx (refused elsewhere; an s3:// URL is warned about)
#   monitoring      CloudWatch agent (signature checked before install) and neuron-monitor
#                   metrics through an interpreter that has boto3
#   termination-watch  trainium-termination-watch.service (termination_watch.sh): the job's
#                   stop grace when the group terminates the node (TERMINATION_HOOK_NAME)
#   lifecycle       BootstrapFailures 0 and the launch lifecycle hook completed with CONTINUE
#   ready           node.env rewritten, ready marker /var/lib/trainium-cluster/ready
# On failure: the failed marker, BootstrapFailures 1 (namespace METRICS_NAMESPACE, dimension
# ClusterName) and ABANDON for the launch lifecycle hook, so the group replaces the node.
#
# /etc/trainium-cluster/node.env (beside cluster.env), rewritten on every boot, holds
# INSTANCE_ID, AMI_ID, LAUNCH_TEMPLATE_VERSION, AUTO_SCALING_GROUP_NAME, SOFTWARE_VERSION,
# BOOT_ID and, where they apply, SCRATCH and TMPDIR (instance store) and WORKLOAD_VENV and
# WORKLOAD_PYTHON (the workload venv and its interpreter; its bin/ has a torchrun that runs
# under it: put that bin/ on PATH before the Neuron venv's, whose own torchrun does not see
# the workload venv).
#
# With INTERNET_EGRESS=endpoints nothing is installed from the internet: anything missing
# fails the run at once with one line that names it. Wheels in a wheels/ folder beside the
# requirements (or WHEELHOUSE) are installed without an index in either mode.
# Idempotent: a second run (or a run after a reboot) changes nothing that is already in place.
set -Eeuo pipefail
# shellcheck source=scripts/node/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

FSTAB="${TRAINIUM_FSTAB:-/etc/fstab}"
PROFILE_DIR="${TRAINIUM_PROFILE_DIR:-/etc/profile.d}"
SYSTEMD_DIR="${TRAINIUM_SYSTEMD_DIR:-/etc/systemd/system}"
TMPFILES_DIR="${TRAINIUM_TMPFILES_DIR:-/etc/tmpfiles.d}"
CW_AGENT_DIR="${TRAINIUM_CW_AGENT_DIR:-/opt/aws/amazon-cloudwatch-agent}"
NEURON_BIN="${TRAINIUM_NEURON_BIN:-/opt/aws/neuron/bin}"
WORKLOAD_VENV="${TRAINIUM_WORKLOAD_VENV:-/opt/trainium-cluster/workload-venv}"
BASE_REQUIREMENTS="${TRAINIUM_BASE_REQUIREMENTS:-$NODE_DIR/workload-requirements.txt}"
SYSTEM_PYTHON="${TRAINIUM_SYSTEM_PYTHON:-/usr/bin/python3}"
IMDS="${TRAINIUM_IMDS:-http://169.254.169.254}"
OS_RELEASE="${TRAINIUM_OS_RELEASE:-/etc/os-release}"
SYS_BLOCK="${TRAINIUM_SYS_BLOCK:-/sys/block}"
DEV_DIR="${TRAINIUM_DEV_DIR:-/dev}"
MDSTAT="${TRAINIUM_MDSTAT:-/proc/mdstat}"
APT_SOURCES_DIR="${TRAINIUM_APT_SOURCES_DIR:-/etc/apt/sources.list.d}"
KEYRING_DIR="${TRAINIUM_KEYRING_DIR:-/usr/share/keyrings}"
APT_LOCK_TIMEOUT="${TRAINIUM_APT_LOCK_TIMEOUT:-900}"
LOCK_POLL="${TRAINIUM_LOCK_POLL:-5}"
# The key that signs the CloudWatch agent packages: "Verifying the signature of the
# CloudWatch agent package" (CloudWatch user guide) gives key ID 3B789C72 with this
# fingerprint. TRAINIUM_CW_AGENT_FINGERPRINT exists for the tests, which sign with their own.
CW_AGENT_FINGERPRINT="${TRAINIUM_CW_AGENT_FINGERPRINT:-937616F3450B7D806CBD9725D58167303B789C72}"
CW_AGENT_KEY_URL="https://amazoncloudwatch-agent.s3.amazonaws.com/assets/amazon-cloudwatch-agent.gpg"
# The model string EC2 gives instance-store NVMe controllers (EBS volumes read
# "Amazon Elastic Block Store"): EC2 user guide, "Instance store volumes", NVMe.
INSTANCE_STORE_MODEL="Amazon EC2 NVMe Instance Storage"
SCRATCH_LABEL="trainium-scratch"
BOOT_UNIT="trainium-bootstrap.service"
DPKG_LOCKS=(/var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock /var/cache/apt/archives/lock)
FAILED_MARKER="$STATE_DIR/failed"
# Packages the Neuron venv ships; installing PyPI builds over them would break it.
NEURON_PACKAGES="torch,torch-xla,torch-neuronx,neuronx-cc,libneuronxla,torchvision,neuronx-distributed"

INSTANCE_ID=""
ASG_NAME=""
TEMPLATE_VERSION=""
GROUP_ERROR=""
LIFECYCLE_ERROR=""
declare -A NODE_VALUES=()

# Leaves the reason of a failed run where preflight (and an operator) will find it, and tells
# CloudWatch and the Auto Scaling group.
on_bootstrap_exit() {
  local status=$?
  stop_heartbeat
  if ((status != 0)); then
    rm -f "$READY_MARKER"
    printf '%s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "${LAST_ERROR:-bootstrap.sh exited with status $status}" \
      >"$FAILED_MARKER" 2>/dev/null || true
    report_failure || true
  fi
}

while (($#)); do
  case $1 in
    --env-file)
      (($# >= 2)) || die "--env-file needs a value"
      ENV_FILE=$2
      shift 2
      ;;
    -h | --help) usage && exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
# Where launch.sh and preflight.sh read it (lib.sh).
NODE_ENV="$NODE_ENV_FILE"

mkdir -p "$STATE_DIR" "$LOG_DIR/jobs" "$LOG_DIR/precompile" "$LOG_DIR/metrics"
exec > >(tee -a "$LOG_DIR/bootstrap.log") 2>&1
exec 9>"$STATE_DIR/bootstrap.lock"
flock -w 1800 9 || die "another bootstrap still holds $STATE_DIR/bootstrap.lock after 30 minutes"
trap 'on_err $LINENO "$BASH_COMMAND"' ERR
trap on_bootstrap_exit EXIT
rm -f "$READY_MARKER" "$FAILED_MARKER"
started=$(date +%s)

os_id() {
  # shellcheck disable=SC1090
  (source "$OS_RELEASE" && echo "${ID:-unknown} ${VERSION_CODENAME:-}")
}

# Replaces $1 with the content of $2 only when they differ; returns 1 when unchanged.
install_if_changed() {
  local target=$1 content=$2
  if [[ -f $target ]] && [[ $(cat "$target") == "$content" ]]; then
    return 1
  fi
  mkdir -p "$(dirname "$target")"
  printf '%s\n' "$content" >"$target.tmp"
  mv "$target.tmp" "$target"
}

# Fails at once when the nodes may not reach the internet: $1 says what is missing, $2 what
# to do instead.
require_internet() {
  [[ ${INTERNET_EGRESS:-nat} != endpoints ]] ||
    die "$1 and INTERNET_EGRESS=endpoints installs nothing from the internet: ${2:-use an AMI that has it}"
}

aws_cli() {
  aws --region "$AWS_REGION" --cli-connect-timeout 10 --cli-read-timeout 30 "$@"
}

# imds <path>: one instance metadata value (IMDSv2); fails when it is absent.
IMDS_TOKEN=""
imds() {
  if [[ -z $IMDS_TOKEN ]]; then
    IMDS_TOKEN=$(curl -sf --retry 3 --max-time 5 -X PUT "$IMDS/latest/api/token" \
      -H "X-aws-ec2-metadata-token-ttl-seconds: 21600") || return 1
  fi
  curl -sf --max-time 5 -H "X-aws-ec2-metadata-token: $IMDS_TOKEN" "$IMDS/latest/meta-data/$1"
}

write_node_env() {
  local key
  {
    echo "# Written by bootstrap.sh on every boot, $(date -u +%Y-%m-%dT%H:%M:%SZ)."
    for key in INSTANCE_ID AMI_ID LAUNCH_TEMPLATE_VERSION AUTO_SCALING_GROUP_NAME SOFTWARE_VERSION \
      BOOT_ID SCRATCH TMPDIR WORKLOAD_VENV WORKLOAD_PYTHON; do
      if [[ -n ${NODE_VALUES[$key]:-} ]]; then
        printf '%s=%q\n' "$key" "${NODE_VALUES[$key]}"
      fi
    done
  } >"$NODE_ENV.tmp"
  mv "$NODE_ENV.tmp" "$NODE_ENV"
}

# Completes the launch lifecycle hook and sets LIFECYCLE_COMPLETED=1 when it did. A later
# boot (reboot) has no pending action: AWS answers "No active Lifecycle Action found", which
# is expected there.
LIFECYCLE_COMPLETED=0
complete_lifecycle() {
  local result=$1 out
  if [[ -z ${LIFECYCLE_HOOK_NAME:-} ]]; then
    log "no LIFECYCLE_HOOK_NAME in cluster.env: no lifecycle hook to complete"
    return 0
  fi
  if [[ -z $ASG_NAME || -z $INSTANCE_ID ]]; then
    log "warning: this instance's Auto Scaling group is unknown: lifecycle hook $LIFECYCLE_HOOK_NAME not completed"
    return 0
  fi
  if out=$(aws_cli autoscaling complete-lifecycle-action --lifecycle-hook-name "$LIFECYCLE_HOOK_NAME" \
    --auto-scaling-group-name "$ASG_NAME" --instance-id "$INSTANCE_ID" \
    --lifecycle-action-result "$result" 2>&1); then
    LIFECYCLE_COMPLETED=1
    log "lifecycle hook $LIFECYCLE_HOOK_NAME completed with $result"
  elif [[ $out == *"No active Lifecycle Action"* ]]; then
    log "no pending launch lifecycle action (a later boot): $result not needed"
  else
    LIFECYCLE_ERROR="could not complete lifecycle hook $LIFECYCLE_HOOK_NAME with $result: $(head -n 1 <<<"$out")"
    return 1
  fi
}

# A launch waits in Pending:Wait for at most the hook's heartbeat timeout (45 minutes,
# stacks/compute.py BOOTSTRAP_TIMEOUT), close to bootstrap's worst case (the dpkg lock alone
# may take 15 minutes). While a launch lifecycle action is pending, a background loop records a
# heartbeat every HEARTBEAT_INTERVAL seconds (RecordLifecycleActionHeartbeat restarts the
# timeout: botocore's autoscaling model), until bootstrap ends or has run HEARTBEAT_LIMIT
# seconds; past that, the hook's timeout abandons a bootstrap that hangs.
HEARTBEAT_INTERVAL="${TRAINIUM_HEARTBEAT_INTERVAL:-600}"
HEARTBEAT_LIMIT="${TRAINIUM_HEARTBEAT_LIMIT:-5400}"
HEARTBEAT_PID=""

record_heartbeat() {
  aws_cli autoscaling record-lifecycle-action-heartbeat --lifecycle-hook-name "$LIFECYCLE_HOOK_NAME" \
    --auto-scaling-group-name "$ASG_NAME" --instance-id "$INSTANCE_ID" 2>&1
}

heartbeat_loop() {
  local sleeper="" out
  trap - ERR
  # The sleep is waited for too: stop_heartbeat's `wait` then returns once nothing of the loop
  # runs (without it the sleep was still there, on its way out, in 140 of 200 stops).
  trap '[[ -z $sleeper ]] || { kill "$sleeper" && wait "$sleeper"; } 2>/dev/null || :; exit 0' TERM
  while (($(date +%s) - started + HEARTBEAT_INTERVAL <= HEARTBEAT_LIMIT)); do
    # In the background, so that TERM ends the wait at once; holding none of bootstrap's output.
    sleep "$HEARTBEAT_INTERVAL" >/dev/null 2>&1 &
    sleeper=$!
    wait "$sleeper" || true
    sleeper=""
    if out=$(record_heartbeat); then
      log "recorded a lifecycle heartbeat (bootstrap has run $(($(date +%s) - started)) s)"
    else
      log "warning: could not record a lifecycle heartbeat: $(head -n 1 <<<"$out")"
    fi
  done
  log "bootstrap has run for ${HEARTBEAT_LIMIT} s: no more lifecycle heartbeats"
}

# Records the first heartbeat; where a launch lifecycle action is pending, starts the loop.
start_heartbeat() {
  local out
  [[ -n ${LIFECYCLE_HOOK_NAME:-} && -n $ASG_NAME && -n $INSTANCE_ID ]] || return 0
  if ! out=$(record_heartbeat); then
    if [[ $out == *"No active Lifecycle Action"* ]]; then
      log "no pending launch lifecycle action (a later boot): no heartbeat to record"
    else
      log "warning: could not record a lifecycle heartbeat: $(head -n 1 <<<"$out")"
    fi
    return 0
  fi
  heartbeat_loop &
  HEARTBEAT_PID=$!
  log "launch lifecycle action pending: a heartbeat every $HEARTBEAT_INTERVAL s for at most $HEARTBEAT_LIMIT s (pid $HEARTBEAT_PID)"
}

stop_heartbeat() {
  [[ -n ${HEARTBEAT_PID:-} ]] || return 0
  kill "$HEARTBEAT_PID" 2>/dev/null || true
  wait "$HEARTBEAT_PID" 2>/dev/null || true
  log "lifecycle heartbeats stopped"
  HEARTBEAT_PID=""
}

put_bootstrap_failures() {
  aws_cli cloudwatch put-metric-data --namespace "$METRICS_NAMESPACE" --metric-name BootstrapFailures \
    --dimensions "ClusterName=$CLUSTER_NAME" --unit Count --value "$1" >/dev/null
}

report_failure() {
  if [[ -z ${AWS_REGION:-} || -z ${CLUSTER_NAME:-} || -z ${METRICS_NAMESPACE:-} ]]; then
    log "cluster settings not loaded: the failure is not reported to CloudWatch"
    return 0
  fi
  [[ -n $INSTANCE_ID ]] || INSTANCE_ID=$(imds instance-id 2>/dev/null) || INSTANCE_ID=""
  if put_bootstrap_failures 1; then
    log "reported BootstrapFailures=1 to $METRICS_NAMESPACE"
  else
    log "warning: could not put BootstrapFailures=1 to $METRICS_NAMESPACE"
  fi
  [[ -n $ASG_NAME || -z $INSTANCE_ID ]] || find_group || true
  complete_lifecycle ABANDON || log "warning: $LIFECYCLE_ERROR"
  # ABANDON ends a launch: the group terminates the node and launches another. A later boot
  # has no launch to abandon, and the group's EC2 status checks still pass: mark the node
  # Unhealthy, and the group replaces it, whether a job runs or not.
  ((LIFECYCLE_COMPLETED)) || mark_unhealthy
}

# Sets this instance's health in its Auto Scaling group to Unhealthy (SetInstanceHealth,
# botocore's autoscaling model: InstanceId and HealthStatus; "Amazon EC2 Auto Scaling
# terminates and replaces the unhealthy instance"). Not respecting the group's grace period:
# that period keeps the group's own checks off a node that is still booting, and bootstrap's
# verdict is final. Should this fail, the failed marker remains, on which preflight exits 3
# (replace this node) and the job supervisor replaces it.
mark_unhealthy() {
  local out
  if [[ -z $INSTANCE_ID ]]; then
    log "warning: this instance's ID is unknown: not marked Unhealthy"
    return 0
  fi
  if [[ -z $ASG_NAME && -z $GROUP_ERROR ]]; then
    log "instance $INSTANCE_ID is in no Auto Scaling group: not marked Unhealthy"
    return 0
  fi
  if out=$(aws_cli autoscaling set-instance-health --instance-id "$INSTANCE_ID" \
    --health-status Unhealthy --no-should-respect-grace-period 2>&1); then
    log "marked $INSTANCE_ID Unhealthy in its Auto Scaling group${ASG_NAME:+ $ASG_NAME}: the group replaces it"
  else
    log "warning: could not mark $INSTANCE_ID Unhealthy: $(head -n 1 <<<"$out")"
  fi
}

phase_environment() {
  [[ -f $ENV_FILE ]] || die "cluster settings $ENV_FILE not found (the instance user data writes it)"
  # cluster.env only: node.env is this run's output, and the last boot's (TMPDIR on a scratch
  # array not yet assembled) must not leak in.
  NODE_ENV_FILE="" load_cluster_env
  local key missing=()
  for key in CLUSTER_NAME AWS_REGION INSTANCE_TYPE NODE_COUNT FSX_DNS_NAME FSX_MOUNT_NAME \
    FSX_MOUNT_POINT COMPILE_CACHE_URL TRAINING_LOG_GROUP NEURON_VENV; do
    [[ -n ${!key:-} ]] || missing+=("$key")
  done
  ((${#missing[@]} == 0)) || die "$ENV_FILE lacks ${missing[*]}"
  [[ $NODE_COUNT =~ ^[1-9][0-9]*$ ]] || die "NODE_COUNT '$NODE_COUNT' in $ENV_FILE is not a number"
  INTERNET_EGRESS="${INTERNET_EGRESS:-nat}"
  [[ $INTERNET_EGRESS == nat || $INTERNET_EGRESS == endpoints ]] ||
    die "INTERNET_EGRESS '$INTERNET_EGRESS' in $ENV_FILE is not allowed: use nat or endpoints"
  # The namespace the node role may publish metrics to (the operations dashboard reads it).
  METRICS_NAMESPACE="${METRICS_NAMESPACE:-TrainiumCluster/$CLUSTER_NAME}"
  log "cluster $CLUSTER_NAME: $NODE_COUNT x $INSTANCE_TYPE in $AWS_REGION, egress $INTERNET_EGRESS"
}

# Sets ASG_NAME and TEMPLATE_VERSION (empty when the instance is in no group): from the
# instance tags EC2 and Auto Scaling set, which the metadata has when the launch template
# allows it, else from autoscaling:DescribeAutoScalingInstances. Never from user data, which
# cannot name the group that launches it.
find_group() {
  local out name version
  ASG_NAME=$(imds tags/instance/aws:autoscaling:groupName 2>/dev/null) || ASG_NAME=""
  TEMPLATE_VERSION=$(imds tags/instance/aws:ec2launchtemplate:version 2>/dev/null) || TEMPLATE_VERSION=""
  [[ -z $ASG_NAME || -z $TEMPLATE_VERSION ]] || return 0
  if ! out=$(aws_cli autoscaling describe-auto-scaling-instances --instance-ids "$INSTANCE_ID" \
    --query 'AutoScalingInstances[0].[AutoScalingGroupName,LaunchTemplate.Version]' --output text 2>&1); then
    GROUP_ERROR="aws autoscaling describe-auto-scaling-instances failed: $(head -n 1 <<<"$out")"
    return 1
  fi
  read -r name version <<<"$out"
  [[ $name != None ]] || name=""
  [[ $version != None ]] || version=""
  ASG_NAME=${ASG_NAME:-$name}
  TEMPLATE_VERSION=${TEMPLATE_VERSION:-$version}
}

phase_identity() {
  INSTANCE_ID=$(imds instance-id) ||
    die "instance metadata (IMDSv2 at $IMDS) did not answer: bootstrap runs on a cluster node"
  NODE_VALUES[INSTANCE_ID]=$INSTANCE_ID
  NODE_VALUES[AMI_ID]=$(imds ami-id) || die "instance metadata has no ami-id"
  find_group || die "$GROUP_ERROR"
  NODE_VALUES[AUTO_SCALING_GROUP_NAME]=$ASG_NAME
  NODE_VALUES[LAUNCH_TEMPLATE_VERSION]=${TEMPLATE_VERSION:-unknown}
  NODE_VALUES[SOFTWARE_VERSION]=${SOFTWARE_VERSION:-unknown}
  NODE_VALUES[BOOT_ID]=$(cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo unknown)
  write_node_env
  start_heartbeat
  log "instance $INSTANCE_ID, ${NODE_VALUES[AMI_ID]}, group ${ASG_NAME:-none}," \
    "launch template version ${NODE_VALUES[LAUNCH_TEMPLATE_VERSION]}, software ${NODE_VALUES[SOFTWARE_VERSION]}"
}

phase_boot_unit() {
  local unit rules changed=0
  # After remote-fs.target: the fstab mount of /fsx has been tried (nofail) before bootstrap
  # looks at it. Type=oneshot has no start time-out by default (systemd.service(5)): bound it.
  unit="[Unit]
Description=Trainium cluster node bootstrap (mounts, scratch, software, lifecycle hook)
Wants=network-online.target
After=network-online.target remote-fs.target

[Service]
Type=oneshot
ExecStart=/bin/bash $NODE_DIR/bootstrap.sh --env-file $ENV_FILE
TimeoutStartSec=45min

[Install]
WantedBy=multi-user.target"
  # A reboot keeps /var/lib: drop the last boot's markers before anything can read them
  # ("r!": remove, at boot only; tmpfiles.d(5)).
  rules="# Written by trainium-cluster bootstrap.sh: bootstrap re-runs on every boot.
r! $READY_MARKER
r! $FAILED_MARKER"
  install_if_changed "$TMPFILES_DIR/trainium-cluster.conf" "$rules" && changed=1
  if install_if_changed "$SYSTEMD_DIR/$BOOT_UNIT" "$unit"; then
    systemctl daemon-reload
    changed=1
  fi
  # Enabled, never started from here: this run is the one it would start.
  systemctl is-enabled --quiet "$BOOT_UNIT" 2>/dev/null || systemctl enable "$BOOT_UNIT"
  if ((changed)); then
    log "$BOOT_UNIT runs bootstrap on every boot"
  else
    log "$BOOT_UNIT already installed"
  fi
}

# Sets SCRATCH_DEVICE to the RAID 0 array over the given devices: the one the kernel already
# assembled (after a reboot), else assembled from their superblocks, else created (first
# boot, or after a stop and start, which leaves the instance store blank).
assemble_scratch() {
  local md
  md=$(awk -v d="${1##*/}" '$2 == ":" && $3 == "active" {
    for (i = 5; i <= NF; i++) if (index($i, d "[") == 1) { print $1; exit } }' "$MDSTAT" 2>/dev/null || true)
  if [[ -n $md ]]; then
    SCRATCH_DEVICE="$DEV_DIR/$md"
    log "instance store already assembled as $SCRATCH_DEVICE"
    return 0
  fi
  SCRATCH_DEVICE="$DEV_DIR/md/$SCRATCH_LABEL"
  if mdadm --assemble "$SCRATCH_DEVICE" "$@" >/dev/null 2>&1; then
    log "assembled $SCRATCH_DEVICE from $# instance-store devices"
    return 0
  fi
  mdadm --create "$SCRATCH_DEVICE" --run --level=0 --raid-devices="$#" --name="$SCRATCH_LABEL" "$@"
  log "created RAID 0 $SCRATCH_DEVICE over $# instance-store devices: $*"
}

phase_scratch() {
  local block model devices=() fs
  if [[ -z ${SCRATCH_DIR:-} ]]; then
    log "no SCRATCH_DIR in cluster.env: temporary files stay on the root volume"
    return 0
  fi
  for block in "$SYS_BLOCK"/nvme*; do
    [[ -r $block/device/model ]] || continue
    read -r model <"$block/device/model" || true
    [[ $model == "$INSTANCE_STORE_MODEL" ]] && devices+=("$DEV_DIR/${block##*/}")
  done
  if ((${#devices[@]} == 0)); then
    log "no instance-store NVMe on this $INSTANCE_TYPE: temporary files stay on the root volume"
    return 0
  fi
  if mountpoint -q "$SCRATCH_DIR"; then
    log "$SCRATCH_DIR is already mounted"
  else
    if ((${#devices[@]} == 1)); then
      SCRATCH_DEVICE=${devices[0]}
    else
      assemble_scratch "${devices[@]}"
    fi
    fs=$(blkid -o value -s TYPE "$SCRATCH_DEVICE" 2>/dev/null || true)
    if [[ -z $fs ]]; then
      # The instance store comes trimmed: skip the discard pass over terabytes.
      mkfs.ext4 -F -q -L "$SCRATCH_LABEL" -E nodiscard "$SCRATCH_DEVICE"
      log "made an ext4 file system on $SCRATCH_DEVICE"
    fi
    mkdir -p "$SCRATCH_DIR"
    mount -o noatime "$SCRATCH_DEVICE" "$SCRATCH_DIR"
    log "mounted $SCRATCH_DEVICE (${#devices[@]} instance-store devices) at $SCRATCH_DIR"
  fi
  mkdir -p "$SCRATCH_DIR/tmp"
  chmod 1777 "$SCRATCH_DIR/tmp"
  NODE_VALUES[SCRATCH]=$SCRATCH_DIR
  NODE_VALUES[TMPDIR]=$SCRATCH_DIR/tmp
  # The Neuron compiler's work directories go under TMPDIR (/tmp/<user>/neuroncc_compile_workdir
  # by default); so do pip's builds for the rest of this run.
  export TMPDIR="$SCRATCH_DIR/tmp"
}

# Prints "<commands> (pids <pids>)" of the processes holding the dpkg/apt locks; fails when
# none does.
dpkg_lock_holders() {
  local pids
  pids=$(fuser "${DPKG_LOCKS[@]}" 2>/dev/null) || return 1
  read -r -a pids <<<"$pids"
  ((${#pids[@]})) || return 1
  echo "$(ps -o comm= -p "$(
    IFS=,
    echo "${pids[*]}"
  )" | sort -u | paste -sd, -) (pids ${pids[*]})"
}

# Waits, up to APT_LOCK_TIMEOUT seconds, until no process holds the dpkg/apt locks: on first
# boot unattended-upgrades holds them for minutes.
wait_for_dpkg_lock() {
  local waited=0 holders
  while holders=$(dpkg_lock_holders); do
    if ((waited >= APT_LOCK_TIMEOUT)); then
      die "the dpkg lock is still held after $APT_LOCK_TIMEOUT s by $holders: packages cannot be installed yet"
    fi
    ((waited > 0)) || log "waiting up to $APT_LOCK_TIMEOUT s for the dpkg lock, held by $holders"
    sleep "$LOCK_POLL"
    waited=$((waited + LOCK_POLL))
  done
}

apt_get() {
  wait_for_dpkg_lock
  # apt-get waits for the frontend lock itself too, in case another process takes it now.
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout="$APT_LOCK_TIMEOUT" "$@"
}

lustre_client_present() {
  command -v mount.lustre >/dev/null 2>&1 && modinfo -k "$(uname -r)" lustre >/dev/null 2>&1
}

install_lustre_client() {
  local id codename kernel
  kernel=$(uname -r)
  require_internet "the Lustre client for kernel $kernel (lustre-client-modules-$kernel) is missing"
  read -r id codename < <(os_id)
  log "installing the Lustre client for $id $codename, kernel $kernel"
  case $id in
    ubuntu)
      # The FSx for Lustre user guide, "Installing the Lustre client", Ubuntu.
      mkdir -p "$KEYRING_DIR" "$APT_SOURCES_DIR"
      curl -fsSL --retry 3 --max-time 60 https://fsx-lustre-client-repo-public-keys.s3.amazonaws.com/fsx-ubuntu-public-key.asc |
        gpg --dearmor --yes -o "$KEYRING_DIR/fsx-ubuntu-public-key.gpg"
      echo "deb [signed-by=$KEYRING_DIR/fsx-ubuntu-public-key.gpg] https://fsx-lustre-client-repo.s3.amazonaws.com/ubuntu $codename main" \
        >"$APT_SOURCES_DIR/fsxlustreclientrepo.list"
      apt_get update -q
      apt_get install -y -q "lustre-client-modules-$kernel"
      ;;
    amzn) dnf install -y -q lustre-client ;;
    *) die "no Lustre client install recipe for $id: install it in the AMI" ;;
  esac
}

phase_fsx() {
  local device="${FSX_DNS_NAME}@tcp:/${FSX_MOUNT_NAME}" line attempt
  # Ubuntu 24.04 has no network.service. _netdev makes it a network mount, nofail keeps a
  # boot from hanging on it, and x-systemd.requires= adds Requires= and After= on
  # network-online.target (systemd.mount(5)). Bootstrap mounts it on every boot anyway.
  line="$device $FSX_MOUNT_POINT lustre defaults,relatime,flock,_netdev,nofail,x-systemd.requires=network-online.target 0 0"
  # A new kernel needs its own lustre-client-modules package: check for this kernel's.
  lustre_client_present || install_lustre_client
  if grep -qxF "$line" "$FSTAB" 2>/dev/null; then
    log "fstab already mounts $FSX_MOUNT_POINT"
  else
    # Drop any older entry for the mount point, then add the current one.
    awk -v mp="$FSX_MOUNT_POINT" '$2 != mp' "$FSTAB" >"$FSTAB.new" 2>/dev/null || true
    echo "$line" >>"$FSTAB.new"
    cat "$FSTAB.new" >"$FSTAB"
    rm -f "$FSTAB.new"
    log "added $FSX_MOUNT_POINT to $FSTAB"
  fi
  if mountpoint -q "$FSX_MOUNT_POINT"; then
    log "$FSX_MOUNT_POINT is already mounted"
  else
    mkdir -p "$FSX_MOUNT_POINT"
    # The file system's DNS name can take a moment to resolve after the stack creates it.
    for attempt in 1 2 3 4 5 6; do
      if mount -t lustre -o relatime,flock "$device" "$FSX_MOUNT_POINT"; then
        break
      fi
      ((attempt < 6)) || die "could not mount $device at $FSX_MOUNT_POINT"
      log "mount attempt $attempt failed; retrying in 10 s"
      sleep 10
    done
    log "mounted $device at $FSX_MOUNT_POINT"
  fi
  mkdir -p "$FSX_MOUNT_POINT/jobs" "$FSX_MOUNT_POINT/data"
}

phase_neuron() {
  local cores verdict
  if [[ $INSTANCE_TYPE != trn* ]]; then
    log "INSTANCE_TYPE $INSTANCE_TYPE has no Neuron devices: skipped"
    return 0
  fi
  export PATH="$NEURON_BIN:$PATH"
  command -v neuron-ls >/dev/null 2>&1 || die "neuron-ls not found: use a Neuron DLAMI"
  if ! grep -q '^neuron ' < <(lsmod || true); then
    log "loading the neuron kernel module"
    modprobe neuron
  fi
  cores=$(neuron_core_count)
  ((cores > 0)) || die "neuron-ls lists no NeuronCores"
  log "$cores NeuronCores visible"
  # The image's Neuron release: its torch-neuronx, compiler, libneuronxla, runtime and driver
  # must lie within the releases that train with PyTorch/XLA (neuron_releases.json).
  verdict=$(python3 "$NODE_DIR/neuron_release.py" check --venv "$NEURON_VENV") || die "$verdict"
  log "$verdict"
}

phase_efa() {
  local providers found
  if ((NODE_COUNT == 1)); then
    log "single-node cluster: EFA not needed"
    return 0
  fi
  command -v fi_info >/dev/null 2>&1 || export PATH="/opt/amazon/efa/bin:$PATH"
  command -v fi_info >/dev/null 2>&1 || die "fi_info not found: the EFA software is not installed"
  providers=$(fi_info -p efa -t FI_EP_RDM 2>&1 || true)
  grep -q 'provider: efa' <<<"$providers" ||
    die "libfabric has no EFA provider: multi-node training needs the EFA interfaces"
  found=$(efa_device_count <<<"$providers")
  if [[ -z ${EFA_DEVICE_COUNT:-} ]]; then
    log "EFA provider present, $found EFA devices (no EFA_DEVICE_COUNT in $ENV_FILE to compare with)"
    return 0
  fi
  [[ $EFA_DEVICE_COUNT =~ ^[0-9]+$ ]] ||
    die "EFA_DEVICE_COUNT '$EFA_DEVICE_COUNT' in $ENV_FILE is not a number of devices"
  ((found >= EFA_DEVICE_COUNT)) ||
    die "found $found EFA devices, expected $EFA_DEVICE_COUNT ($INSTANCE_TYPE): a lost EFA device is a hardware fault"
  log "$found EFA devices, $EFA_DEVICE_COUNT expected"
}

# The workload venv: a venv whose site-packages come before the Neuron venv's (a .pth file
# adds those after its own, site.addsitedir so that their .pth files work too). The Neuron
# venv is never written to.
make_workload_venv() {
  local neuron_python=$1 python="$WORKLOAD_VENV/bin/python" own lines="" dir
  if [[ ! -x $python || $(cat "$WORKLOAD_VENV/neuron-venv" 2>/dev/null) != "$NEURON_VENV" ]]; then
    "$neuron_python" -m venv --clear --without-pip "$WORKLOAD_VENV"
    echo "$NEURON_VENV" >"$WORKLOAD_VENV/neuron-venv"
    log "created the workload venv $WORKLOAD_VENV over $NEURON_VENV"
  fi
  own=$("$python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  while read -r dir; do
    lines+="import site; site.addsitedir('$dir')"$'\n'
  done < <("$neuron_python" -c 'import sysconfig
for d in dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]): print(d)')
  install_if_changed "$own/trainium-neuron-venv.pth" "${lines%$'\n'}" || true
  # torchrun (torch's console script) under this interpreter, so that the job's workers, which
  # torchrun starts with its own interpreter, see the workload venv. Put this bin/ before the
  # Neuron venv's on PATH: neuronx-cc and neuron_parallel_compile stay the Neuron venv's.
  install_if_changed "$WORKLOAD_VENV/bin/torchrun" "#!$python
# Written by trainium-cluster bootstrap.sh: torchrun with the workload venv's interpreter.
import sys

from torch.distributed.run import main

sys.exit(main())" || true
  chmod 755 "$WORKLOAD_VENV/bin/torchrun"
}

phase_python() {
  local neuron_python="$NEURON_VENV/bin/python" python="$WORKLOAD_VENV/bin/python" plan constraints
  local wheelhouse="${WHEELHOUSE:-$(dirname "$BASE_REQUIREMENTS")/wheels}" source_args=()
  if [[ ! -x $neuron_python ]]; then
    [[ $INSTANCE_TYPE != trn* ]] || die "Neuron venv $NEURON_VENV not found: use the Neuron DLAMI with PyTorch 2.9"
    log "no venv at $NEURON_VENV: skipped"
    return 0
  fi
  make_workload_venv "$neuron_python"
  NODE_VALUES[WORKLOAD_VENV]=$WORKLOAD_VENV
  NODE_VALUES[WORKLOAD_PYTHON]=$python
  constraints="$STATE_DIR/neuron-constraints.txt"
  plan=$("$python" "$NODE_DIR/requirements_diff.py" "$BASE_REQUIREMENTS" \
    --keep "$NEURON_PACKAGES" --constraints "$constraints")
  if [[ -z $plan ]]; then
    log "the workload venv already has every pinned workload requirement"
    return 0
  fi
  if [[ -d $wheelhouse ]]; then
    source_args=(--no-index --find-links "$wheelhouse")
  else
    require_internet "the workload needs $(paste -sd' ' <<<"$plan"), which the Neuron venv lacks," \
      "ship its wheels in $wheelhouse or use an AMI that has them"
  fi
  log "installing into $WORKLOAD_VENV: $(paste -sd' ' <<<"$plan")"
  # The Neuron venv's pip installs into the workload venv (pip --python); the constraints keep
  # the Neuron stack's packages at the Neuron venv's versions. A package the Neuron venv has
  # at another version is installed beside it, never removed from it: pip uninstalls nothing
  # outside the target environment (pip/_internal/req/req_uninstall.py, "Not uninstalling
  # ... outside environment").
  # shellcheck disable=SC2086  # one requirement per word
  "$neuron_python" -m pip --python "$python" install --quiet --disable-pip-version-check \
    "${source_args[@]}" -c "$constraints" $plan
  "$neuron_python" -m pip --python "$python" check ||
    log "warning: pip check reports conflicts in $WORKLOAD_VENV (listed above)"
}

phase_compile_cache() {
  local content cache mount
  # The cache is a directory on the shared file system (the storage stack links it to the
  # compile-cache bucket): the node's Lustre client serves its ranks' look-ups, and the
  # entries' lock files are coherent across nodes because phase_fsx mounts with `flock`.
  # Anywhere else each node would compile alone, or every rank ask S3 (stacks/start_limits.py).
  case $COMPILE_CACHE_URL in
    s3://*)
      log "warning: COMPILE_CACHE_URL $COMPILE_CACHE_URL is in S3: every rank of a job asks S3 for each graph, over the prefix's 5,500 GET/s from 43 nodes; use a directory under $FSX_MOUNT_POINT"
      ;;
    /*)
      cache=$(realpath -m -- "$COMPILE_CACHE_URL")
      mount=$(realpath -m -- "$FSX_MOUNT_POINT")
      if [[ $cache != "$mount"/?* ]] || ! mountpoint -q "$FSX_MOUNT_POINT"; then
        die "COMPILE_CACHE_URL '$COMPILE_CACHE_URL' in $ENV_FILE is not on the mounted shared file system: use a directory under $FSX_MOUNT_POINT"
      fi
      mkdir -p "$cache"
      ;;
    *) die "COMPILE_CACHE_URL '$COMPILE_CACHE_URL' in $ENV_FILE is not allowed: use a directory under $FSX_MOUNT_POINT (or an s3:// URL)" ;;
  esac
  content="# Written by trainium-cluster bootstrap.sh: shared Neuron compile cache.
export NEURON_COMPILE_CACHE_URL=\"$COMPILE_CACHE_URL\""
  if install_if_changed "$PROFILE_DIR/trainium-cluster.sh" "$content"; then
    log "compile cache: NEURON_COMPILE_CACHE_URL=$COMPILE_CACHE_URL (login shells; launch.sh sets it for jobs)"
  else
    log "compile cache already points at $COMPILE_CACHE_URL"
  fi
}

# verify_signature <key> <signature> <file> <fingerprint>: true when <signature> is a good
# signature of <file> by the key with <fingerprint> (or one of its subkeys).
verify_signature() {
  local home status
  home=$(mktemp -d)
  gpg --homedir "$home" --batch --quiet --import "$1" >/dev/null 2>&1 || true
  status=$(gpg --homedir "$home" --batch --status-fd 1 --verify "$2" "$3" 2>/dev/null || true)
  gpgconf --homedir "$home" --kill all >/dev/null 2>&1 || true
  rm -rf "$home"
  awk -v fpr="$4" '$1 == "[GNUPG:]" && $2 == "VALIDSIG" && ($3 == fpr || $NF == fpr) {found = 1}
    END {exit !found}' <<<"$status"
}

install_cloudwatch_agent() {
  local id dir base
  require_internet "the CloudWatch agent is not installed"
  read -r id _ < <(os_id)
  log "installing the CloudWatch agent"
  case $id in
    ubuntu | debian)
      # CloudWatch user guide: download the package and its .sig, verify with AWS's public
      # key, then install. Trainium instances are x86_64.
      dir=$(mktemp -d)
      base="https://amazoncloudwatch-agent-$AWS_REGION.s3.$AWS_REGION.amazonaws.com/ubuntu/amd64/latest"
      curl -fsSL --retry 3 --max-time 300 -o "$dir/amazon-cloudwatch-agent.deb" "$base/amazon-cloudwatch-agent.deb"
      curl -fsSL --retry 3 --max-time 60 -o "$dir/amazon-cloudwatch-agent.deb.sig" "$base/amazon-cloudwatch-agent.deb.sig"
      curl -fsSL --retry 3 --max-time 60 -o "$dir/amazon-cloudwatch-agent.gpg" "$CW_AGENT_KEY_URL"
      if ! verify_signature "$dir/amazon-cloudwatch-agent.gpg" "$dir/amazon-cloudwatch-agent.deb.sig" \
        "$dir/amazon-cloudwatch-agent.deb" "$CW_AGENT_FINGERPRINT"; then
        rm -rf "$dir"
        die "the CloudWatch agent package from $base is not signed by key $CW_AGENT_FINGERPRINT: not installed"
      fi
      log "CloudWatch agent package signature verified (key $CW_AGENT_FINGERPRINT)"
      wait_for_dpkg_lock
      dpkg -i -E "$dir/amazon-cloudwatch-agent.deb"
      rm -rf "$dir"
      ;;
    amzn) dnf install -y -q amazon-cloudwatch-agent ;;
    *) die "no CloudWatch agent install recipe for $id" ;;
  esac
}

# The first interpreter that can import boto3, which neuron-monitor-cloudwatch.py needs
# (Neuron monitor user guide, "Companion scripts").
monitor_python() {
  local candidate
  for candidate in "$NEURON_VENV/bin/python" "$SYSTEM_PYTHON" "${NODE_VALUES[WORKLOAD_PYTHON]:-}"; do
    if [[ -n $candidate && -x $candidate ]] && "$candidate" -c 'import boto3' >/dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

phase_monitoring() {
  local ctl="$CW_AGENT_DIR/bin/amazon-cloudwatch-agent-ctl" config unit monitor python disks
  [[ -x $ctl ]] || install_cloudwatch_agent
  disks="\"/\", \"$FSX_MOUNT_POINT\"${NODE_VALUES[SCRATCH]:+, \"${NODE_VALUES[SCRATCH]}\"}"
  # The agent ships only the newest file that a wildcard matches (CloudWatch agent user guide,
  # "file_path"): precompile's logs get an entry and a stream of their own, so that a
  # precompile and the job after it do not take turns in one stream. A job's metrics file
  # (launch.sh TRAINIUM_METRICS_FILE, one JSON object a line: docs/job-contract.md) goes to
  # <instance-id>/metrics, which `cluster.py jobs` reads.
  config=$(
    cat <<JSON
{
  "agent": {"metrics_collection_interval": 60, "run_as_user": "root"},
  "logs": {
    "force_flush_interval": 15,
    "logs_collected": {"files": {"collect_list": [
      {"file_path": "$LOG_DIR/bootstrap.log", "log_group_name": "$TRAINING_LOG_GROUP",
       "log_stream_name": "{instance_id}/bootstrap"},
      {"file_path": "$LOG_DIR/jobs/*.log", "log_group_name": "$TRAINING_LOG_GROUP",
       "log_stream_name": "{instance_id}/jobs"},
      {"file_path": "$LOG_DIR/precompile/*.log", "log_group_name": "$TRAINING_LOG_GROUP",
       "log_stream_name": "{instance_id}/precompile"},
      {"file_path": "$LOG_DIR/metrics/*.jsonl", "log_group_name": "$TRAINING_LOG_GROUP",
       "log_stream_name": "{instance_id}/metrics"}
    ]}}
  },
  "metrics": {
    "namespace": "$METRICS_NAMESPACE",
    "append_dimensions": {"InstanceId": "\${aws:InstanceId}"},
    "metrics_collected": {
      "mem": {"measurement": ["mem_used_percent"]},
      "disk": {"measurement": ["used_percent"], "resources": [$disks]}
    }
  }
}
JSON
  )
  if install_if_changed "$CW_AGENT_DIR/etc/trainium-cluster.json" "$config" ||
    ! systemctl is-active --quiet amazon-cloudwatch-agent; then
    "$ctl" -a fetch-config -m ec2 -s -c "file:$CW_AGENT_DIR/etc/trainium-cluster.json"
    log "CloudWatch agent ships $LOG_DIR logs to $TRAINING_LOG_GROUP"
  else
    log "CloudWatch agent already running with this configuration"
  fi

  monitor="$NEURON_BIN/neuron-monitor-cloudwatch.py"
  if [[ ! -x $NEURON_BIN/neuron-monitor || ! -f $monitor ]]; then
    log "no neuron-monitor on this node: Neuron metrics skipped"
    return 0
  fi
  python=$(monitor_python) ||
    die "neuron-monitor-cloudwatch.py needs boto3 and none of $NEURON_VENV/bin/python, $SYSTEM_PYTHON${NODE_VALUES[WORKLOAD_PYTHON]:+, ${NODE_VALUES[WORKLOAD_PYTHON]}} can import it"
  unit="[Unit]
Description=neuron-monitor metrics to CloudWatch ($METRICS_NAMESPACE)
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/bin/bash -c '$NEURON_BIN/neuron-monitor | $python $monitor --namespace $METRICS_NAMESPACE --region $AWS_REGION'
Restart=always
RestartSec=30

[Install]
WantedBy=multi-user.target"
  if install_if_changed "$SYSTEMD_DIR/trainium-neuron-monitor.service" "$unit"; then
    systemctl daemon-reload
    systemctl enable trainium-neuron-monitor.service
    systemctl restart trainium-neuron-monitor.service
    log "neuron-monitor publishes to CloudWatch namespace $METRICS_NAMESPACE (through $python)"
  else
    systemctl is-active --quiet trainium-neuron-monitor.service ||
      systemctl start trainium-neuron-monitor.service
    log "neuron-monitor service already installed"
  fi
}

# The termination watch (termination_watch.sh): a service that gives a job on this node its stop
# grace when the group terminates the node, within the group's termination lifecycle hook
# (TERMINATION_HOOK_NAME). It ends once it has completed that hook: Restart=on-failure.
phase_termination_watch() {
  local unit
  if [[ -z ${TERMINATION_HOOK_NAME:-} ]]; then
    log "no TERMINATION_HOOK_NAME in cluster.env: no termination watch"
    return 0
  fi
  unit="[Unit]
Description=trainium-cluster: stop the job with its grace when the node is terminated
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/bin/bash $NODE_DIR/termination_watch.sh
Restart=on-failure
RestartSec=10

[Install]
WantedBy=multi-user.target"
  if install_if_changed "$SYSTEMD_DIR/trainium-termination-watch.service" "$unit"; then
    systemctl daemon-reload
    systemctl enable trainium-termination-watch.service
    systemctl restart trainium-termination-watch.service
    log "termination watch installed (lifecycle hook $TERMINATION_HOOK_NAME)"
  else
    systemctl is-active --quiet trainium-termination-watch.service ||
      systemctl start trainium-termination-watch.service
    log "termination watch already installed"
  fi
}

phase_lifecycle() {
  stop_heartbeat
  put_bootstrap_failures 0 || log "warning: could not put BootstrapFailures=0 to $METRICS_NAMESPACE"
  complete_lifecycle CONTINUE || die "$LIFECYCLE_ERROR"
}

phase_ready() {
  write_node_env
  printf 'ready %s, bootstrap took %d s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(($(date +%s) - started))" \
    >"$READY_MARKER"
  log "node ready: $READY_MARKER; node settings in $NODE_ENV"
}

phase environment phase_environment
phase identity phase_identity
phase boot-unit phase_boot_unit
phase scratch phase_scratch
phase fsx phase_fsx
phase neuron phase_neuron
phase efa phase_efa
phase python phase_python
phase compile-cache phase_compile_cache
phase monitoring phase_monitoring
phase termination-watch phase_termination_watch
phase lifecycle phase_lifecycle
phase ready phase_ready
