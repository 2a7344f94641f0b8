# shellcheck shell=bash
# A job's own Python dependencies (docs/job-contract.md, "Python dependencies"). Sourced by
# launch.sh after lib.sh, never run.
#
#   prepare_job_python <code-dir> [<snapshot-sha>]
#
# When the job's code snapshot has a requirements.txt, its packages go into an environment
# of their own on this node, built once per node per snapshot and kept in
# $JOB_ENV_CACHE/<sha> (/var/cache/trainium-cluster/envs/<sha>; <sha> defaults to the code
# directory's name, which is the snapshot's sha256): every later leg, attempt and job with
# that snapshot on this node reuses it without a pip call. The environment is a venv layered
# on the image's Python (the interpreter launch.sh's activate_python puts first on PATH: the
# workload venv over the Neuron venv): `python -m venv --system-site-packages` gives a venv the
# base interpreter's site-packages only (sys.base_prefix; "venv" in the Python library
# reference), not a parent venv's, so a .pth file adds each site-packages directory the image's
# Python sees, after the job's own (site.addsitedir, so that their .pth files work too).
# Packages the image has already (torch, torch-neuronx) are found there and not installed
# again; the Neuron stack's versions are pinned by bootstrap's constraints file when present.
#
# Installed with `pip install --no-index --find-links <code-dir>/wheels -r requirements.txt`
# when the snapshot has a wheels/ folder (no network: the herd of nodes never reaches the
# package index; docs/job-contract.md counts it), else from the package index. pip runs as the
# image's pip aimed at the new venv (pip --python, pip >= 22.3).
#
# Once per node even when several launches prepare at once: the build runs under flock on
# $JOB_ENV_CACHE/<sha>.lock and looks again once it holds the lock. Atomic: the venv is built
# in a directory of its own ($JOB_ENV_CACHE/<sha>.XXXXXX), then the name <sha> is made a
# symbolic link to it with rename(2). The directory itself never moves, because pip writes the
# venv's absolute path into the console scripts it installs (their #! lines). A failed build
# leaves no <sha>: the next launch builds again; pip's output stays in <sha>.failed.log.
#
# Afterwards the environment's bin/ is first on PATH (a torchrun there starts the workers
# with its interpreter) and TRAINIUM_PYTHON_ENV names it. Without requirements.txt nothing
# changes.

JOB_ENV_CACHE="${TRAINIUM_ENV_CACHE:-/var/cache/trainium-cluster/envs}"
# The longest a launch waits for another launch's build of the same environment.
JOB_ENV_LOCK_SECONDS="${TRAINIUM_ENV_LOCK_SECONDS:-1800}"

prepare_job_python() {
  local code_dir=$1 sha=${2:-} requirements env parent lock
  requirements="$code_dir/requirements.txt"
  [[ -f $requirements ]] || return 0
  [[ -n $sha ]] || sha=$(basename "$code_dir")
  [[ $sha =~ ^[0-9a-f]{64}$ ]] ||
    die "the job's Python environment is named by its snapshot's sha256 (64 lowercase hex digits), not '$sha'"
  parent=$(command -v python3 || command -v python) ||
    die "no python3 on PATH to layer the job's environment on"
  env="$JOB_ENV_CACHE/$sha"
  mkdir -p "$JOB_ENV_CACHE"
  if [[ ! -x $env/bin/python ]]; then
    exec {lock}>"$env.lock"
    flock -w "$JOB_ENV_LOCK_SECONDS" "$lock" ||
      die "waited $JOB_ENV_LOCK_SECONDS s for another launch's build of $env ($env.lock): stop it or remove the lock"
    if [[ -x $env/bin/python ]]; then
      log "the job's Python environment $env was built meanwhile by another launch"
    else
      build_job_python "$code_dir" "$sha" "$parent"
    fi
    exec {lock}>&-
  else
    log "the job's Python environment $env is there already (snapshot $sha): no install"
  fi
  PATH="$env/bin:$PATH"
  export TRAINIUM_PYTHON_ENV="$env" PATH
}

# build_job_python <code-dir> <sha> <parent python>: under the lock, with no <sha> yet.
build_job_python() {
  local code_dir=$1 sha=$2 parent=$3 build own pth sources=() constraints=() status=0 link
  local constraints_file
  local pip_log="$JOB_ENV_CACHE/$sha.failed.log"
  if [[ -d $code_dir/wheels ]]; then
    sources=(--no-index --find-links "$code_dir/wheels")
  fi
  constraints_file="${NEURON_CONSTRAINTS:-$STATE_DIR/neuron-constraints.txt}"
  if [[ -f $constraints_file ]]; then
    constraints=(-c "$constraints_file")
  fi
  build=$(mktemp -d "$JOB_ENV_CACHE/$sha.XXXXXX")
  log "installing the job's $code_dir/requirements.txt into $build over $parent (${sources[*]:-from the package index})"
  "$parent" -m venv --system-site-packages --without-pip "$build"
  own=$("$build/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  pth=$("$parent" -c 'import site, sys
for d in dict.fromkeys(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))):
    print(f"import site; site.addsitedir({d!r})")')
  printf '%s\n' "$pth" >"$own/trainium-image-python.pth"
  "$parent" -m pip --python "$build/bin/python" install --disable-pip-version-check \
    --no-input "${sources[@]}" "${constraints[@]}" -r "$code_dir/requirements.txt" \
    >"$pip_log" 2>&1 || status=$?
  if ((status)); then
    rm -rf "$build"
    die "pip could not install the job's requirements.txt (status $status): $(grep -E 'ERROR|error' "$pip_log" | tail -n 1)${sources[*]:+ (from $code_dir/wheels only)}; pip's output: $pip_log"
  fi
  rm -f "$pip_log"
  # torchrun under the job's interpreter: the workers it starts see the job's packages.
  if "$build/bin/python" -c 'import torch.distributed.run' 2>/dev/null; then
    printf '%s\n' "#!$build/bin/python" \
      "# Written by trainium-cluster job_python.sh: torchrun with the job's interpreter." \
      "import sys" "" "from torch.distributed.run import main" "" "sys.exit(main())" \
      >"$build/bin/torchrun"
    chmod 755 "$build/bin/torchrun"
  fi
  link="$JOB_ENV_CACHE/.$sha.link.$$"
  ln -sfn "$(basename "$build")" "$link"
  mv -T "$link" "$JOB_ENV_CACHE/$sha"
  log "the job's Python environment for snapshot $sha is ready: $JOB_ENV_CACHE/$sha"
}
