#!/usr/bin/env bash
# Fills the shared Neuron compile cache ahead of a job.
#
#   precompile.sh --hosts IP1,IP2,... --job-id ID [--master-port 29500]
#                 [--nproc-per-node auto|N] [--steps 10] [--node-address ADDR]
#                 (--code SHA256 | --code-dir DIR) [--entry ENTRY] [--data /fsx/PATH]
#                 -- <the entry point's args>
#
# Runs the job exactly as launch.sh would, for --steps steps, under neuron_parallel_compile:
# the trial run only extracts the XLA graphs, then compiles them in parallel into the
# compile cache (NEURON_COMPILE_CACHE_URL: /fsx/neuron-compile-cache, shared by all nodes,
# which the file system exports to the compile-cache bucket), so that the real run of
# the job finds its graphs compiled. The trial run writes to a node-local scratch directory,
# never to the job's own output, whose checkpoints it would otherwise spoil. The node's copy
# of the output goes to /var/log/trainium-cluster/precompile/<job-id>.log, beside (not among)
# the jobs' logs in jobs/, which the CloudWatch agent ships by a wildcard of its own.
set -Eeuo pipefail
# shellcheck source=scripts/node/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
trap 'on_err $LINENO "$BASH_COMMAND"' ERR

launch_args=() job_id="" steps=10
while (($#)); do
  case $1 in
    --hosts | --master-port | --nproc-per-node | --node-address | --code | --code-dir | --entry | --data)
      (($# >= 2)) || die "$1 needs a value (see --help)"
      launch_args+=("$1" "$2")
      shift 2
      ;;
    --job-id | --steps)
      (($# >= 2)) || die "$1 needs a value (see --help)"
      if [[ $1 == --job-id ]]; then job_id=$2; else steps=$2; fi
      shift 2
      ;;
    -h | --help) usage && exit 0 ;;
    --) shift && break ;;
    *) die "unknown option '$1': options come first, then -- and the train.py arguments (see --help)" ;;
  esac
done

[[ -n $job_id ]] || die "--job-id is required"
validate_job_id "$job_id"
[[ $steps =~ ^[1-9][0-9]{0,3}$ ]] || die "--steps '$steps' is not allowed: use a number of steps from 1 to 9999"
# neuron_parallel_compile lives in the Neuron venv's bin, which Run Command's PATH lacks.
load_cluster_env || true
activate_python
command -v neuron_parallel_compile >/dev/null 2>&1 ||
  die "neuron_parallel_compile not found: precompiling needs the Neuron SDK (NEURON_VENV=${NEURON_VENV:-unset} has none)"

scratch="${TRAINIUM_PRECOMPILE_DIR:-/var/tmp/trainium-cluster/precompile}"
rm -rf "${scratch:?}/$job_id"
mkdir -p "$scratch"
log "precompiling job $job_id: $steps steps under neuron_parallel_compile, scratch output $scratch/$job_id"
status=0
# The scratch output is emptied above: always a new job there.
bash "$NODE_DIR/launch.sh" "${launch_args[@]}" --job-id "$job_id" --jobs-root "$scratch" \
  --wrap neuron_parallel_compile --log-folder precompile --resume new -- "$@" --max-steps "$steps" || status=$?
rm -rf "${scratch:?}/$job_id/checkpoints"
if ((status != 0)); then
  die "precompiling job $job_id failed with status $status (log: $scratch/$job_id/logs)"
fi
log "precompiled job $job_id: its graphs are in the compile cache ${NEURON_COMPILE_CACHE_URL:-${COMPILE_CACHE_URL:-(local default)}}"
