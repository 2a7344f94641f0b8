#!/usr/bin/env bash
# Stops a training job's processes on this node.
#
#   stop.sh --job-id ID [--grace 120] [--node-address ADDR]
#
# Finds the processes launch.sh started for the job (torchrun and its workers, by the
# TRAINIUM_JOB_ID tag in their environment), sends SIGTERM to the workers (the trainers save
# a checkpoint and exit), then to torchrun once they have ended, and SIGKILL to whatever is
# left after --grace seconds. The workers get the whole grace: torchrun, signalled first,
# would SIGKILL them after 30 s (stop_job in lib.sh). The job's checkpoints stay where
# they are: launching the same job ID again resumes from the latest one.
# --node-address limits the stop to one node's processes where several nodes share a
# machine (the local rehearsal).
set -Eeuo pipefail
# shellcheck source=scripts/node/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
trap 'on_err $LINENO "$BASH_COMMAND"' ERR

job_id="" grace=120 node_address=""
while (($#)); do
  case $1 in
    --job-id | --grace | --node-address)
      (($# >= 2)) || die "$1 needs a value (see --help)"
      case $1 in
        --job-id) job_id=$2 ;;
        --grace) grace=$2 ;;
        --node-address) node_address=$2 ;;
      esac
      shift 2
      ;;
    -h | --help) usage && exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

[[ -n $job_id ]] || die "--job-id is required"
validate_job_id "$job_id"
[[ $grace =~ ^[0-9]{1,5}$ ]] || die "--grace '$grace' is not a number of seconds"

if stop_job "$job_id" "$grace" "$node_address"; then
  log "job $job_id stopped on this node"
else
  log "job $job_id has no running processes on this node"
fi
