#!/usr/bin/env bash
# Gives the job on this node its stop grace when the Auto Scaling group terminates the node.
#
#   termination_watch.sh [--interval 5] [--grace 120]
#
# Runs as a service (trainium-termination-watch.service, installed by bootstrap.sh). Every
# --interval seconds it reads the instance metadata item autoscaling/target-lifecycle-state
# (IMDSv2), which Auto Scaling sets to "Terminated" when the node is to be terminated, for
# any scale-in, a replacement or a Capacity Block's end (Amazon EC2 Auto Scaling user guide,
# "Retrieve the target lifecycle state through instance metadata":
# https://docs.aws.amazon.com/autoscaling/ec2/userguide/retrieving-target-lifecycle-state-through-imds.html).
# The group's termination lifecycle hook (TERMINATION_HOOK_NAME in cluster.env, stacks/
# compute.py) keeps the node running meanwhile. Then it marks the node as terminating
# (TERMINATING_MARKER: launch.sh then reports a job that ended as failed, so that its
# supervisor retries it from the checkpoint rather than calling it finished), stops every job
# process on the node as stop.sh does (SIGTERM to the trainers, which save at the step they
# agree on, SIGKILL after --grace seconds), and completes the lifecycle action with CONTINUE:
# the node goes at once instead of at the hook's time-out.
set -Eeuo pipefail
# shellcheck source=scripts/node/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
trap 'on_err $LINENO "$BASH_COMMAND"' ERR

interval=5 grace=120
while (($#)); do
  case $1 in
    --interval | --grace)
      (($# >= 2)) || die "$1 needs a value (see --help)"
      [[ $2 =~ ^[0-9]{1,5}$ ]] || die "$1 '$2' is not a number of seconds"
      case $1 in
        --interval) interval=$2 ;;
        --grace) grace=$2 ;;
      esac
      shift 2
      ;;
    -h | --help) usage && exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

load_cluster_env || die "no $ENV_FILE: this is not a cluster node"
IMDS="${TRAINIUM_IMDS:-http://169.254.169.254}"

# Reads the target lifecycle state into $state (empty while IMDS does not answer). A token
# lasts 6 hours: a refused read asks for a new one next time.
token="" state=""
read_target_state() {
  state=""
  if [[ -z $token ]]; then
    token=$(curl -sf --max-time 5 -X PUT "$IMDS/latest/api/token" \
      -H "X-aws-ec2-metadata-token-ttl-seconds: 21600") || return 0
  fi
  state=$(curl -sf --max-time 5 -H "X-aws-ec2-metadata-token: $token" \
    "$IMDS/latest/meta-data/autoscaling/target-lifecycle-state") || token=""
}

rm -f "$TERMINATING_MARKER" # a marker of an earlier life of this node's state folder
log "watching autoscaling/target-lifecycle-state every $interval s"
read_target_state
until [[ $state == Terminated ]]; do
  sleep "$interval"
  read_target_state
done

log "this node is being terminated: stopping its job processes with a $grace s grace"
mkdir -p "$(dirname "$TERMINATING_MARKER")"
date -u +%Y-%m-%dT%H:%M:%SZ >"$TERMINATING_MARKER"
if stop_job "*" "$grace"; then
  log "the job processes on this node stopped"
else
  log "no job process runs on this node"
fi

if [[ -z ${TERMINATION_HOOK_NAME:-} || -z ${AUTO_SCALING_GROUP_NAME:-} || -z ${INSTANCE_ID:-} ]]; then
  log "no termination hook, group or instance ID known: the hook's time-out lets the node go"
  exit 0
fi
if out=$(aws --region "$AWS_REGION" --cli-connect-timeout 10 --cli-read-timeout 30 \
  autoscaling complete-lifecycle-action --lifecycle-hook-name "$TERMINATION_HOOK_NAME" \
  --auto-scaling-group-name "$AUTO_SCALING_GROUP_NAME" --instance-id "$INSTANCE_ID" \
  --lifecycle-action-result CONTINUE 2>&1); then
  log "lifecycle hook $TERMINATION_HOOK_NAME completed with CONTINUE"
else
  log "could not complete lifecycle hook $TERMINATION_HOOK_NAME (its time-out lets the node go): $(head -n 1 <<<"$out")"
fi
