#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/mokd/epilog.sh), run as root on
# each node once a job has ended: every session the job left in mokd (a task
# killed without closing, a stray process) is closed and what it held is
# freed before the next job gets the node. It waits until the daemon has let
# them go; if it cannot, it exits non-zero and Slurm drains the node. No
# daemon running holds nothing: that is success.
set -u
here=$(dirname "$0")
# shellcheck source=/dev/null
[ -r "$here/mokd-slurm.conf" ] && . "$here/mokd-slurm.conf"
MOKCTL=${MOKCTL:-/usr/local/bin/mokctl}
MOKD_SOCKET=${MOKD_SOCKET:-/run/mokd/mokd.sock}
MOKD_EVICT_WAIT=${MOKD_EVICT_WAIT:-60}

[ -n "${SLURM_JOB_ID:-}" ] || { echo "mokd epilog: SLURM_JOB_ID is not set" >&2; exit 1; }
[ -S "$MOKD_SOCKET" ] || exit 0
if out=$("$MOKCTL" --socket "$MOKD_SOCKET" evict --job "$SLURM_JOB_ID" \
         --timeout "$MOKD_EVICT_WAIT" 2>&1); then
  case $out in
    *" 0 sessions closed"*) ;;
    *) echo "mokd epilog: $out" >&2 ;;
  esac
  exit 0
fi
# a socket nobody answers on: the daemon is gone, and its memory with it
case $out in
  *"cannot connect to mokd"*) exit 0 ;;
esac
echo "mokd epilog: job $SLURM_JOB_ID: $out" >&2
exit 1
