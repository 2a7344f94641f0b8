#!/usr/bin/env bash
# A job's code and data on a node: the code snapshot fetched, checked and unpacked once per
# node, and the job's data path. Sourced by launch.sh after lib.sh, never run.
#
# The operator CLI packs the job's code directory into a tarball named by its sha256 and
# uploads it to s3://<data bucket>/code/<sha256>.tar.gz (scripts/cluster_lib/code.py). The
# data repository association links that bucket to /fsx/data with automatic import of new
# objects, so the node finds it at /fsx/data/code/<sha256>.tar.gz once FSx has imported it.
# The FSx for Lustre User Guide ("Automatically import updates from your S3 bucket",
# autoimport-data-repo-dra.html) documents no bound on that delay: the wait here is bounded
# generously (CODE_WAIT_SECONDS, 900 s), and a snapshot still absent then, or whose sha256
# differs, ends the job with the contract's input status 2 (the supervisor does not retry
# it: the same input would fail again). The unpacked snapshot lives in a node-local cache,
# /var/cache/trainium-cluster/code/<sha256>/, made under a lock (every process of a node
# that starts the job at once unpacks it once) and renamed into place whole, so a folder
# there is always a complete snapshot.
#
# Paths and bounds can be redirected through the environment (the rehearsal, the tests):
#   TRAINIUM_CODE_CACHE  the node-local cache          (/var/cache/trainium-cluster/code)
#   TRAINIUM_CODE_WAIT   seconds to wait for a snapshot (900)

# shellcheck disable=SC2034  # CODE_DIR and DATA_DIR are read by launch.sh
CODE_CACHE="${TRAINIUM_CODE_CACHE:-/var/cache/trainium-cluster/code}"
CODE_WAIT_SECONDS="${TRAINIUM_CODE_WAIT:-900}"
CODE_SHA_PATTERN='^[0-9a-f]{64}$'
# The EntryPoint parameter's rule (stacks/ssm_documents/RunTraining.yaml).
ENTRY_PATTERN='^(-m [A-Za-z_][A-Za-z0-9_]*([.][A-Za-z_][A-Za-z0-9_]*)*|[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*[.]py)$'
# The DataPath parameter's rule.
DATA_PATTERN='^(/fsx(/[A-Za-z0-9_][A-Za-z0-9._=+-]*)*)?$'
# A job whose own input (its code, its data) is wrong ends with input_error (lib.sh): status 2,
# which the supervisor does not retry.

# A path on the cluster's file system as this node mounts it: /fsx/... under FSX_MOUNT_POINT.
fsx_path() {
  local mount=${FSX_MOUNT_POINT:-/fsx}
  printf '%s\n' "$mount${1#/fsx}"
}

# Waits (CODE_WAIT_SECONDS at most) until <path> exists; fails otherwise.
# wait_for_path <path> <what>
wait_for_path() {
  local path=$1 what=$2 start=$SECONDS next_note=0
  while [[ ! -e $path ]]; do
    if ((SECONDS - start >= CODE_WAIT_SECONDS)); then
      return 1
    fi
    if ((SECONDS - start >= next_note)); then
      log "waiting for $what at $path (the file system imports new objects of the data bucket; up to $CODE_WAIT_SECONDS s)"
      next_note=$((next_note + 60))
    fi
    sleep 2
  done
}

# Fetches, checks and unpacks the snapshot <sha> once on this node; sets CODE_DIR to it.
# unpack_code <sha>
unpack_code() {
  local sha=$1 tarball dir actual staging lock
  [[ $sha =~ $CODE_SHA_PATTERN ]] ||
    input_error "--code '$sha' is not a code snapshot's sha256 (64 lowercase hex digits)"
  dir="$CODE_CACHE/$sha"
  if [[ -d $dir ]]; then
    CODE_DIR=$dir
    log "code: snapshot $sha, unpacked on this node already ($dir)"
    return 0
  fi
  tarball=$(fsx_path "/fsx/data/code/$sha.tar.gz")
  wait_for_path "$tarball" "code snapshot $sha" ||
    input_error "code snapshot $sha is not at $tarball after $CODE_WAIT_SECONDS s: upload it with \`cluster.py train --code DIR\` (it puts s3://<data bucket>/code/$sha.tar.gz)"
  mkdir -p "$CODE_CACHE"
  exec {lock}>"$CODE_CACHE/.$sha.lock"
  flock "$lock"
  if [[ ! -d $dir ]]; then
    actual=$(sha256sum "$tarball" | cut -d' ' -f1)
    if [[ $actual != "$sha" ]]; then
      exec {lock}>&-
      input_error "code snapshot $tarball has sha256 $actual, not $sha: upload it again with \`cluster.py train --code DIR\`"
    fi
    staging=$(mktemp -d "$CODE_CACHE/.$sha.XXXXXX")
    if ! tar --no-same-owner -xzf "$tarball" -C "$staging"; then
      rm -rf "$staging"
      exec {lock}>&-
      input_error "code snapshot $tarball could not be unpacked"
    fi
    chmod 755 "$staging"
    mv -T "$staging" "$dir"
    log "code: snapshot $sha unpacked to $dir"
  fi
  exec {lock}>&-
  CODE_DIR=$dir
}

# The job's data on this node: "" or a path under /fsx, waited for like the code (a prefix
# uploaded just before the job may not be imported yet). Sets DATA_DIR.
# resolve_data <path>
resolve_data() {
  DATA_DIR=""
  [[ -n $1 ]] || return 0
  [[ $1 =~ $DATA_PATTERN ]] ||
    input_error "--data '$1' is not allowed: use a path under /fsx (letters, digits and . _ = + - in its names)"
  DATA_DIR=$(fsx_path "$1")
  wait_for_path "$DATA_DIR" "the job's data" ||
    input_error "the job's data $1 is not on the file system ($DATA_DIR) after $CODE_WAIT_SECONDS s"
}
