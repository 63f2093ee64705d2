#!/usr/bin/env bash
# check_deploy.sh BUILD PYTHON - deploy/k8s and deploy/slurm: the manifests
# (tests/check_k8s.py), shellcheck of the Slurm scripts when it is installed,
# and the scripts' logic against a real mokd: the prolog starting a daemon
# that is not there, the task prolog's exports, the epilog evicting one job's
# sessions (their memory freed) while another job's stay.
set -euo pipefail
build=${1:?usage: check_deploy.sh BUILD PYTHON}
py=${2:?usage: check_deploy.sh BUILD PYTHON}
slurm=deploy/slurm
fail() { echo "check_deploy: $*" >&2; exit 1; }

"$py" tests/check_k8s.py
if command -v shellcheck >/dev/null 2>&1; then
  shellcheck -s sh "$slurm"/*.sh
  echo "check_deploy: shellcheck of $slurm ok"
else
  echo "check_deploy: shellcheck not installed; skipped (deploy/install-deps.sh installs it)"
fi

dir=$(mktemp -d /tmp/mokd-slurm-XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  if [ -f "$dir/mokd.pid" ]; then kill "$(cat "$dir/mokd.pid")" 2>/dev/null || true; fi
  rm -rf "$dir"
}
trap cleanup EXIT
export MOKCTL=$PWD/$build/mokctl MOKD_SOCKET=$dir/mokd.sock MOKD_WAIT=20 MOKD_EVICT_WAIT=10
export MOKD_START="$PWD/$build/mokd --backend cpu --config /dev/null --cpu-threads 1 \
  --socket $dir/mokd.sock 2>$dir/mokd.log & echo \$! > $dir/mokd.pid"

# prolog: no daemon yet, so it starts one and waits for it to be healthy
SLURM_JOB_ID=4242 sh "$slurm/prolog.sh" || fail "prolog failed; $(cat "$dir/mokd.log")"
"$MOKCTL" --socket "$MOKD_SOCKET" health >/dev/null || fail "no healthy mokd after the prolog"
SLURM_JOB_ID=4242 MOKD_START=false sh "$slurm/prolog.sh" || fail "prolog on a healthy mokd"
MOKD_SOCKET=$dir/none.sock MOKD_START=true MOKD_WAIT=1 sh "$slurm/prolog.sh" 2>/dev/null &&
  fail "prolog succeeded with no daemon coming up"

# task prolog: the task's environment
out=$(SLURM_JOB_ID=4242 sh "$slurm/task_prolog.sh")
[ "$out" = "export MOKD_SOCKET=$dir/mokd.sock
export MOKD_JOB_ID=4242" ] || fail "task prolog printed: $out"

# two jobs' tasks, each holding memory in the daemon, taking their
# environment as the task prolog gives it
hold() {
  local exports
  mapfile -t exports < <(SLURM_JOB_ID=$1 sh "$slurm/task_prolog.sh" | sed 's/^export //')
  env "${exports[@]}" \
    PYTHONPATH=client/python MOK_LIB="$build/libmok.so" "$py" -c '
import os, time, mokd
c = mokd.Client(os.environ["MOKD_SOCKET"])
a = c.arena(1 << 20)
print("up", flush=True)
time.sleep(120)' > "$dir/hold-$1" 2>&1 &
  pids+=($!)
}
hold 4242
hold 5353
for _ in $(seq 200); do
  grep -q up "$dir/hold-4242" && grep -q up "$dir/hold-5353" && break
  sleep 0.05
done
sessions=$("$MOKCTL" --socket "$MOKD_SOCKET" sessions)
echo "$sessions" | grep -q ' 4242 ' || fail "job 4242 has no session: $sessions"

# epilog of job 4242: its session gone and its memory back; 5353's stays
SLURM_JOB_ID=4242 sh "$slurm/epilog.sh" 2>"$dir/epilog.err" || fail "epilog: $(cat "$dir/epilog.err")"
grep -q "evicted job 4242: 1 session closed, their memory freed" "$dir/epilog.err" ||
  fail "epilog said: $(cat "$dir/epilog.err")"
sessions=$("$MOKCTL" --socket "$MOKD_SOCKET" sessions)
echo "$sessions" | grep -q ' 4242 ' && fail "job 4242 still has a session: $sessions"
echo "$sessions" | awk '$4 == "5353" && $7 >= 1048576 {ok = 1} END {exit !ok}' ||
  fail "job 5353 lost its session: $sessions"
# twice, and for a job that never came: nothing to do, success
SLURM_JOB_ID=4242 sh "$slurm/epilog.sh" || fail "second epilog"
SLURM_JOB_ID=1 sh "$slurm/epilog.sh" || fail "epilog of a job without sessions"
# no daemon at all holds nothing
MOKD_SOCKET=$dir/none.sock SLURM_JOB_ID=1 sh "$slurm/epilog.sh" || fail "epilog without mokd"
env -u SLURM_JOB_ID sh "$slurm/epilog.sh" 2>/dev/null && fail "epilog without SLURM_JOB_ID"
echo "check_deploy: slurm prolog, task prolog and epilog ok against a real mokd"
