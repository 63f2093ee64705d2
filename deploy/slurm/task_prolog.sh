#!/bin/sh
# Slurm TaskProlog (slurm.conf: TaskProlog=/etc/slurm/mokd/task_prolog.sh),
# run as the job's user before each task: what it prints as "export NAME=VALUE"
# Slurm puts into the task's environment. libmok (C and Python) then finds
# the node's daemon and sends the job id in its Hello, so that mokctl
# sessions, the metrics and the epilog's evict know whose memory is whose.
set -u
here=$(dirname "$0")
# shellcheck source=/dev/null
[ -r "$here/mokd-slurm.conf" ] && . "$here/mokd-slurm.conf"
echo "export MOKD_SOCKET=${MOKD_SOCKET:-/run/mokd/mokd.sock}"
[ -n "${SLURM_JOB_ID:-}" ] && echo "export MOKD_JOB_ID=$SLURM_JOB_ID"
exit 0
