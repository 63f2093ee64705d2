#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/mokd/prolog.sh), run as root on
# each node of a job before it starts: makes sure the node's mokd is up and
# healthy, starting it when it is not. A non-zero exit drains the node, which
# is right when mokd cannot serve. Settings (environment, or mokd-slurm.conf next
# to this script): MOKCTL, MOKD_SOCKET, MOKD_START (the command that starts
# the daemon), MOKD_WAIT (seconds to wait for it to be ready).
set -u
here=$(dirname "$0")
# shellcheck source=/dev/null
[ -r "$here/mokd-slurm.conf" ] && . "$here/mokd-slurm.conf"
MOKCTL=${MOKCTL:-/usr/local/bin/mokctl}
MOKD_SOCKET=${MOKD_SOCKET:-/run/mokd/mokd.sock}
MOKD_START=${MOKD_START:-systemctl start mokd}
MOKD_WAIT=${MOKD_WAIT:-60}

healthy() {
  "$MOKCTL" --socket "$MOKD_SOCKET" health --timeout 10 >/dev/null 2>&1
}

healthy && exit 0
echo "mokd prolog: job ${SLURM_JOB_ID:-?}: mokd not ready on $MOKD_SOCKET; starting it" >&2
sh -c "$MOKD_START" || { echo "mokd prolog: '$MOKD_START' failed" >&2; exit 1; }
i=0
while [ "$i" -lt "$MOKD_WAIT" ]; do
  healthy && exit 0
  sleep 1
  i=$((i + 1))
done
echo "mokd prolog: mokd not ready after ${MOKD_WAIT} s:" \
  "$("$MOKCTL" --socket "$MOKD_SOCKET" health --timeout 10 2>&1)" >&2
exit 1
