#!/usr/bin/env bash
# Prepares a cluster node for training; the instance user data runs it after unpacking
# /opt/trainium-cluster and writing cluster.env.
#
#   bootstrap.sh [--env-file /etc/trainium-cluster/cluster.env]
#
# Phases, each logged with its duration to /var/log/trainium-cluster/bootstrap.log:
#   environment     read and check cluster.env
#   fsx             install the Lustre client if missing, add the FSx mount to fstab (once),
#                   mount it at FSX_MOUNT_POINT unless already mounted
#   neuron          Neuron driver loaded, NeuronCores visible (neuron-ls)
#   efa             libfabric EFA provider present (multi-node clusters)
#   python          install workload/requirements.txt into the Neuron venv, only the
#                   packages whose installed version differs; never the Neuron SDK's own
#   workload        the workload asset is unpacked at WORKLOAD_DIR
#   compile-cache   point the Neuron persistent compile cache at COMPILE_CACHE_URL
#   monitoring      CloudWatch agent (bootstrap and job logs, memory and disk metrics) and
#                   neuron-monitor metrics, both under METRICS_NAMESPACE
#   ready           write the ready marker /var/lib/trainium-cluster/ready
# Idempotent: a second run (or a run after a reboot) changes nothing that is already in
# place. On failure it logs the failing line and leaves /var/lib/trainium-cluster/failed.
set -Eeuo pipefail
# shellcheck source=scripts/node/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

FSTAB="${TRAINIUM_FSTAB:-/etc/fstab}"
PROFILE_DIR="${TRAINIUM_PROFILE_DIR:-/etc/profile.d}"
SYSTEMD_DIR="${TRAINIUM_SYSTEMD_DIR:-/etc/systemd/system}"
CW_AGENT_DIR="${TRAINIUM_CW_AGENT_DIR:-/opt/aws/amazon-cloudwatch-agent}"
NEURON_BIN="${TRAINIUM_NEURON_BIN:-/opt/aws/neuron/bin}"
FAILED_MARKER="$STATE_DIR/failed"
# Packages the Neuron venv ships; installing PyPI builds over them would break it.
NEURON_PACKAGES="torch,torch-xla,torch-neuronx,neuronx-cc,libneuronxla,torchvision,neuronx-distributed"

# Leaves the reason of a failed run where preflight (and an operator) will find it.
on_bootstrap_exit() {
  local status=$?
  if ((status != 0)); then
    printf '%s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "${LAST_ERROR:-bootstrap.sh exited with status $status}" \
      >"$FAILED_MARKER" 2>/dev/null || true
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

mkdir -p "$STATE_DIR" "$LOG_DIR/jobs"
exec > >(tee -a "$LOG_DIR/bootstrap.log") 2>&1
exec 9>"$STATE_DIR/bootstrap.lock"
flock -w 1800 9 || die "another bootstrap still holds $STATE_DIR/bootstrap.lock after 30 minutes"
trap 'on_err $LINENO "$BASH_COMMAND"' ERR
trap on_bootstrap_exit EXIT
rm -f "$READY_MARKER" "$FAILED_MARKER"
started=$(date +%s)

os_id() {
  # shellcheck disable=SC1091
  (source /etc/os-release && echo "${ID:-unknown} ${VERSION_CODENAME:-}")
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

phase_environment() {
  [[ -f $ENV_FILE ]] || die "cluster settings $ENV_FILE not found (the instance user data writes it)"
  load_cluster_env
  local key missing=()
  for key in CLUSTER_NAME AWS_REGION INSTANCE_TYPE NODE_COUNT FSX_DNS_NAME FSX_MOUNT_NAME \
    FSX_MOUNT_POINT COMPILE_CACHE_URL TRAINING_LOG_GROUP WORKLOAD_DIR NEURON_VENV; do
    [[ -n ${!key:-} ]] || missing+=("$key")
  done
  ((${#missing[@]} == 0)) || die "$ENV_FILE lacks ${missing[*]}"
  [[ $NODE_COUNT =~ ^[1-9][0-9]*$ ]] || die "NODE_COUNT '$NODE_COUNT' in $ENV_FILE is not a number"
  # The namespace the node role may publish metrics to (the operations dashboard reads it).
  METRICS_NAMESPACE="${METRICS_NAMESPACE:-TrainiumCluster/$CLUSTER_NAME}"
  log "cluster $CLUSTER_NAME: $NODE_COUNT x $INSTANCE_TYPE in $AWS_REGION"
}

install_lustre_client() {
  local id codename
  read -r id codename < <(os_id)
  log "installing the Lustre client for $id $codename"
  case $id in
    ubuntu)
      curl -fsSL https://fsx-lustre-client-repo-public-keys.s3.amazonaws.com/fsx-ubuntu-public-key.asc |
        gpg --dearmor --yes -o /usr/share/keyrings/fsx-ubuntu-public-key.gpg
      echo "deb [signed-by=/usr/share/keyrings/fsx-ubuntu-public-key.gpg] https://fsx-lustre-client-repo.s3.amazonaws.com/ubuntu $codename main" \
        >/etc/apt/sources.list.d/fsxlustreclientrepo.list
      apt-get update -q
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q "lustre-client-modules-$(uname -r)"
      ;;
    amzn) dnf install -y -q lustre-client ;;
    *) die "no Lustre client install recipe for $id: install it in the AMI" ;;
  esac
}

phase_fsx() {
  local device="${FSX_DNS_NAME}@tcp:/${FSX_MOUNT_NAME}" line attempt
  line="$device $FSX_MOUNT_POINT lustre defaults,relatime,flock,_netdev,x-systemd.automount,x-systemd.requires=network.service 0 0"
  command -v mount.lustre >/dev/null 2>&1 || install_lustre_client
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
  local cores
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
}

phase_efa() {
  if ((NODE_COUNT == 1)); then
    log "single-node cluster: EFA not needed"
    return 0
  fi
  command -v fi_info >/dev/null 2>&1 || export PATH="/opt/amazon/efa/bin:$PATH"
  command -v fi_info >/dev/null 2>&1 || die "fi_info not found: the EFA software is not installed"
  grep -q 'provider: efa' < <(fi_info -p efa -t FI_EP_RDM 2>&1 || true) ||
    die "libfabric has no EFA provider: multi-node training needs the EFA interfaces"
  log "EFA provider present"
}

phase_python() {
  local python="$NEURON_VENV/bin/python" plan constraints
  if [[ ! -x $python ]]; then
    [[ $INSTANCE_TYPE != trn* ]] || die "Neuron venv $NEURON_VENV not found: use the Neuron DLAMI with PyTorch 2.9"
    log "no venv at $NEURON_VENV: skipped"
    return 0
  fi
  constraints="$STATE_DIR/neuron-constraints.txt"
  plan=$("$python" "$NODE_DIR/requirements_diff.py" "$WORKLOAD_DIR/requirements.txt" \
    --keep "$NEURON_PACKAGES" --constraints "$constraints")
  if [[ -z $plan ]]; then
    log "the Neuron venv already has every pinned workload requirement"
    return 0
  fi
  log "installing into $NEURON_VENV: $(paste -sd' ' <<<"$plan")"
  # shellcheck disable=SC2086  # one requirement per word
  "$python" -m pip install --quiet --disable-pip-version-check -c "$constraints" $plan
  "$python" -m pip check || log "warning: pip check reports conflicts in $NEURON_VENV (listed above)"
}

phase_workload() {
  [[ -f $WORKLOAD_DIR/train.py ]] || die "the workload asset is not unpacked: no $WORKLOAD_DIR/train.py"
  log "workload at $WORKLOAD_DIR"
}

phase_compile_cache() {
  local content
  content="# Written by trainium-cluster bootstrap.sh: shared Neuron compile cache.
export NEURON_COMPILE_CACHE_URL=\"$COMPILE_CACHE_URL\""
  if install_if_changed "$PROFILE_DIR/trainium-cluster.sh" "$content"; then
    log "compile cache: NEURON_COMPILE_CACHE_URL=$COMPILE_CACHE_URL (login shells; launch.sh sets it for jobs)"
  else
    log "compile cache already points at $COMPILE_CACHE_URL"
  fi
}

install_cloudwatch_agent() {
  local id package
  read -r id _ < <(os_id)
  log "installing the CloudWatch agent"
  case $id in
    ubuntu | debian)
      package=$(mktemp --suffix=.deb)
      curl -fsSL -o "$package" \
        "https://amazoncloudwatch-agent-$AWS_REGION.s3.$AWS_REGION.amazonaws.com/ubuntu/amd64/latest/amazon-cloudwatch-agent.deb"
      dpkg -i -E "$package"
      rm -f "$package"
      ;;
    amzn) dnf install -y -q amazon-cloudwatch-agent ;;
    *) die "no CloudWatch agent install recipe for $id" ;;
  esac
}

phase_monitoring() {
  local ctl="$CW_AGENT_DIR/bin/amazon-cloudwatch-agent-ctl" config unit monitor
  [[ -x $ctl ]] || install_cloudwatch_agent
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
       "log_stream_name": "{instance_id}/jobs"}
    ]}}
  },
  "metrics": {
    "namespace": "$METRICS_NAMESPACE",
    "append_dimensions": {"InstanceId": "\${aws:InstanceId}"},
    "metrics_collected": {
      "mem": {"measurement": ["mem_used_percent"]},
      "disk": {"measurement": ["used_percent"], "resources": ["/", "$FSX_MOUNT_POINT"]}
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
  unit="[Unit]
Description=neuron-monitor metrics to CloudWatch ($METRICS_NAMESPACE)
After=network-online.target

[Service]
ExecStart=/bin/bash -c '$NEURON_BIN/neuron-monitor | $NEURON_VENV/bin/python $monitor --namespace $METRICS_NAMESPACE --region $AWS_REGION'
Restart=always
RestartSec=30

[Install]
WantedBy=multi-user.target"
  if install_if_changed "$SYSTEMD_DIR/trainium-neuron-monitor.service" "$unit"; then
    systemctl daemon-reload
    systemctl enable trainium-neuron-monitor.service
    systemctl restart trainium-neuron-monitor.service
    log "neuron-monitor publishes to CloudWatch namespace $METRICS_NAMESPACE"
  else
    systemctl is-active --quiet trainium-neuron-monitor.service ||
      systemctl start trainium-neuron-monitor.service
    log "neuron-monitor service already installed"
  fi
}

phase_ready() {
  printf 'ready %s, bootstrap took %d s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(($(date +%s) - started))" \
    >"$READY_MARKER"
  log "node ready: $READY_MARKER"
}

phase environment phase_environment
phase fsx phase_fsx
phase neuron phase_neuron
phase efa phase_efa
phase python phase_python
phase workload phase_workload
phase compile-cache phase_compile_cache
phase monitoring phase_monitoring
phase ready phase_ready
