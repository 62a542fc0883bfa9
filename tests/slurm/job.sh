#!/bin/bash
# One SLURM array task of tests/host/test_slurm.py: one offline Inspect eval
# with --sandbox nsbox.
#
#   sbatch --array=0-2 job.sh VENV TASK_FILE OUT_DIR
#
# VENV holds inspect and nsbox; the eval's log goes to OUT_DIR/logs-<i>
# and this script's exit status to OUT_DIR/status-<i>.
#
# Each task is given an XDG_RUNTIME_DIR nsbox cannot use, as batch jobs
# often are, so that nsbox's fallback (a private /dev/shm/nsbox-$UID) is
# what runs:
#   0  unset (no login session made one)
#   1  /run/user/$UID that does not exist (pam_slurm_adopt, no systemd
#      user session on the node)
#   2  a directory that belongs to another user (inherited through su,
#      sudo or sbatch's environment export)
set -uo pipefail
venv=$1 task=$2 out=$3
i=${SLURM_ARRAY_TASK_ID:?not a SLURM array task}
trap 'echo $? >"$out/status-$i"' EXIT

case $((i % 3)) in
    0) unset XDG_RUNTIME_DIR ;;
    1) XDG_RUNTIME_DIR=/run/user/$(id -u)
       [[ -e $XDG_RUNTIME_DIR ]] && XDG_RUNTIME_DIR=/nonexistent$XDG_RUNTIME_DIR
       export XDG_RUNTIME_DIR ;;
    2) export XDG_RUNTIME_DIR=/root ;;
esac
echo "array task $i of job ${SLURM_ARRAY_JOB_ID:-?} on $(hostname) as $(id -un):" \
     "XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR-<unset>}"

# From the task's directory: Inspect (0.3.285 on Python 3.11, at least)
# fails on an absolute task path ("Non-relative patterns are unsupported").
cd "$(dirname "$task")"
"$venv/bin/inspect" eval "$(basename "$task")" --sandbox nsbox --log-dir "$out/logs-$i" --log-format json --display plain
