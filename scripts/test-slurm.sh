#!/usr/bin/env bash
# `make test-slurm`: a real single-node Slurm cluster on this host runs the job `earl-stream slurm submit`
# renders (supervisor, rollout and trainer as three heterogeneous-job components; the trainer via srun +
# torchrun) for a few training steps of a tiny model, and the job's summary is checked.
#
# Needs root: installs Debian's slurm-wlm and munge when absent, starts munged (unless one runs),
# slurmctld and three slurmd with a slurm.conf generated in a temp dir, and stops the daemons it started
# by their pid files on every exit, failures included.
# Three nodes on one host: Slurm 22.05 plans a heterogeneous job node by node (its backfill scheduler,
# the only one that starts het jobs, gives each component whole nodes), so the three components never
# start on a single node, whatever its CPUs or OverSubscribe (measured here: pending on Resources). Each
# slurmd runs as its own node (`slurmd -N nX`, NodeAddr 127.0.0.1, its own port), CPUs=2 each: this host.
# Then, under `salloc -N 3`, the tests marked `slurm`: `earl-stream up --launcher slurm` placing the pools
# as srun steps (extra arguments go to that pytest).
# Environment: PY (the project's python, default .venv/bin/python), SLURM_TEST_TIMEOUT (seconds the job
# may take, default 900), SLURM_TEST_KEEP=1 keeps the temp dir, SLURM_TEST_SKIP_UP=1 stops after the sbatch
# jobs, SLURM_TEST_STOP_TIME=00:03:00 lets the second job's time limit stop it (Slurm's --signal) instead
# of `scancel --batch --signal=TERM`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
BIN=$(dirname "$PY")
TIMEOUT=${SLURM_TEST_TIMEOUT:-900}
started=$(date +%s)

# Without root (apt-get, munged, slurmctld, slurmd) the tier cannot run: it says so and skips, as the
# Prometheus test does, rather than failing a CI that has no root.
[[ $(id -u) == 0 ]] || { echo "test-slurm: SKIPPED: needs root (apt-get, munged, slurmctld, slurmd)"; exit 0; }
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    echo "test-slurm: installing slurm-wlm and munge"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
fi

WORK=$(mktemp -d /tmp/earl-slurm.XXXXXX)
chmod 755 "$WORK"
HOST=$(hostname -s)
PIDS=()  # pid files of the daemons this script started

teardown() {
    local rc=$?
    for pidfile in "${PIDS[@]}"; do
        [[ -s $pidfile ]] || continue
        local pid
        pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$pid" 2>/dev/null || true
    done
    if [[ $rc != 0 ]]; then
        echo "test-slurm: FAILED (exit $rc); logs:"
        for f in "$WORK"/run/slurm-*.out "$WORK"/run/logs/*.log "$WORK"/slurmctld.log "$WORK"/slurmd-*.log; do
            [[ -f $f ]] && { echo "--- $f"; tail -n 25 "$f"; }
        done
    fi
    [[ ${SLURM_TEST_KEEP:-0} == 1 ]] || rm -rf "$WORK"
    echo "test-slurm: $(( $(date +%s) - started )) s"
    exit $rc
}
trap teardown EXIT

# munge: one key, a daemon owned by the munge user (a running one is left alone, and not stopped)
if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge
if ! pidof munged >/dev/null; then
    runuser -u munge -- munged --force
    PIDS+=(/run/munge/munged.pid)
fi

mkdir -p "$WORK/state"
export SLURM_CONF=$WORK/slurm.conf
cat > "$SLURM_CONF" <<EOF
ClusterName=earltest
SlurmctldHost=$HOST
SlurmctldPort=${SLURM_TEST_CTLD_PORT:-16817}
SlurmdPort=${SLURM_TEST_SLURMD_PORT:-16818}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool-%n
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd-%n.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd-%n.log
NodeName=n0 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$(( ${SLURM_TEST_SLURMD_PORT:-16818} + 1 )) CPUs=2 RealMemory=6000
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$(( ${SLURM_TEST_SLURMD_PORT:-16818} + 2 )) CPUs=2 RealMemory=6000
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$(( ${SLURM_TEST_SLURMD_PORT:-16818} + 3 )) CPUs=2 RealMemory=6000
PartitionName=debug Nodes=n[0-2] Default=YES MaxTime=INFINITE State=UP
EOF
slurmctld -c -f "$SLURM_CONF"
PIDS=("$WORK/slurmctld.pid" "${PIDS[@]}")
for node in n0 n1 n2; do
    slurmd -N "$node" -f "$SLURM_CONF"
    PIDS=("$WORK/slurmd-$node.pid" "${PIDS[@]}")  # stopped before slurmctld
done
for _ in $(seq 120); do
    [[ $(sinfo -h -o %t 2>/dev/null) == idle ]] && break
    sleep 0.5
done
[[ $(sinfo -h -o %t) == idle ]] || { echo "test-slurm: the nodes did not come up idle: $(sinfo -h 2>&1)"; exit 1; }
echo "test-slurm: cluster up in $(( $(date +%s) - started )) s: $(sinfo -h)"

# the run: a tiny model, 3 steps, 2 groups of 4 episodes per step
HF_HUB_OFFLINE=1 "$BIN/earl-stream" init-model "$WORK/model" >/dev/null
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
cat > "$WORK/run.yaml" <<EOF
run_dir: $WORK/run
steps: 3
model: {path: $WORK/model}
trainer: {groups_per_step: 2, group_size: 4, checkpoint_every: 3}
rollout: {groups_in_flight: 2}
slurm:
  command: $BIN/earl-stream
  torchrun: $BIN/torchrun
  time: "00:20:00"
  master_port: $PORT
  setup: export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
EOF
out=$("$BIN/earl-stream" slurm submit --config "$WORK/run.yaml")
echo "test-slurm: $out"
JOB=$(sed -E 's/^submitted job ([0-9]+).*/\1/' <<<"$out")
deadline=$(( $(date +%s) + TIMEOUT ))
while [[ -n $(squeue -h -j "$JOB" 2>/dev/null) ]]; do
    if (( $(date +%s) > deadline )); then
        scancel "$JOB" || true
        echo "test-slurm: job $JOB still running after ${TIMEOUT}s"; exit 1
    fi
    sleep 2
done
scontrol show job "$JOB" > "$WORK/job.txt" || true
grep -E "JobId|JobState|^ *NodeList=" "$WORK/job.txt" || true
cat "$WORK/run/slurm-$JOB.out"
"$PY" - "$WORK/run/summary-$JOB.json" "$WORK/run/earl-stream.sbatch" "$WORK/job.txt" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
roles = sorted(w["role"] for w in s["workers"])
assert s["policy_version"] == 3, f"policy version {s['policy_version']} != 3"
assert s["samples_consumed"] == 3 * 2 * 4, s["samples_consumed"]
assert s["duplicates_detected"] == 0 and s["samples_lost"] == 0, s
assert roles == ["rollout", "trainer"], roles
assert open(sys.argv[2]).read().count("#SBATCH hetjob") == 2
# scontrol show job: one record per component, each on its own node
nodes = sorted(ln.split("NodeList=")[1].split()[0] for ln in open(sys.argv[3]) if ln.strip().startswith("NodeList="))
assert nodes == ["n0", "n1", "n2"], nodes
print(f"test-slurm: OK: 3 steps, {s['samples_consumed']} samples trained, workers {roles}, "
      f"hosts {sorted({w['host'] for w in s['workers']})}")
EOF
grep -q "trainer pool exited with 0" "$WORK/run/slurm-$JOB.out"

# 1b) a run without an end, stopped early the way the job's time limit stops it (--signal=B:TERM@...):
# SIGTERM to the batch shell, which stops the trainer first; its ranks finish the step and checkpoint it.
sed -e "s|run_dir: $WORK/run|run_dir: $WORK/run2|" -e "s|^steps: 3|steps: 0|" \
    -e "s|checkpoint_every: 3}|checkpoint_every: 1000}|" "$WORK/run.yaml" > "$WORK/run2.yaml"
out=$("$BIN/earl-stream" slurm submit --config "$WORK/run2.yaml" trainer.stop_grace_s=30 \
      "slurm.time=${SLURM_TEST_STOP_TIME:-00:20:00}")
JOB=$(sed -E 's/^submitted job ([0-9]+).*/\1/' <<<"$out")
deadline=$(( $(date +%s) + TIMEOUT ))
steps_done() {  # the run's policy version, from its supervisor (0 until it answers)
    local ready=$WORK/run2/supervisor-$JOB.json
    [[ -s $ready ]] || { echo 0; return; }
    "$BIN/earl-stream" status --secret-file "$WORK/run2/secret" --encrypt --json --supervisor \
        "tcp://127.0.0.1:$(grep -o '"address": *"[^"]*"' "$ready" | sed -E 's/.*:([0-9]+)"$/\1/')" 2>/dev/null \
        | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["policy_version"])' 2>/dev/null || echo 0
}
job_state() {  # RUNNING, PENDING, COMPLETED, ... ("" while scontrol does not answer)
    scontrol show job "$JOB" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | head -n1 | cut -d= -f2
}
until (( $(steps_done) >= 2 )); do
    (( $(date +%s) < deadline )) || { scancel "$JOB"; echo "test-slurm: job $JOB made no 2 steps"; exit 1; }
    [[ $(job_state) =~ ^(|PENDING|RUNNING|CONFIGURING)$ ]] || { echo "test-slurm: job $JOB ended: $(job_state)"; exit 1; }
    sleep 2
done
[[ ${SLURM_TEST_STOP_TIME:-} ]] || scancel --batch --signal=TERM "$JOB"  # else the time limit's signal
while [[ $(job_state) =~ ^(|PENDING|RUNNING|CONFIGURING|COMPLETING)$ ]]; do
    (( $(date +%s) < deadline )) || { scancel "$JOB"; echo "test-slurm: job $JOB did not stop"; exit 1; }
    sleep 2
done
echo "test-slurm: job $JOB ended $(job_state)"
cat "$WORK/run2/slurm-$JOB.out"
grep -q "trainer pool exited with 0 (stopped by SIGTERM)" "$WORK/run2/slurm-$JOB.out"
"$PY" - "$WORK/run2" "$JOB" <<'EOF'
import json, sys
from pathlib import Path
run, job = Path(sys.argv[1]), sys.argv[2]
s = json.load(open(run / f"summary-{job}.json"))
steps = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
# a stop during a step finishes it and checkpoints it without publishing it: the checkpoint may hold one
# step more than the supervisor's version (a resume starts from the checkpoint)
last = int(steps[-1].split("_")[1]) if steps else -1
assert s["policy_version"] >= 2 and s["policy_version"] <= last <= s["policy_version"] + 1, (steps, s["policy_version"])
assert s["samples_lost"] == 0 and s["duplicates_detected"] == 0, s
print(f"test-slurm: OK: stopped by SIGTERM at version {s['policy_version']}, checkpoint {steps[-1]} written, "
      f"nothing lost")
EOF

# 2) `up --launcher slurm` inside an allocation of the three nodes: the tests marked `slurm` (the launcher
# contract, and a run whose trainer pool spans two nodes) run under salloc, which holds the nodes and sets
# $SLURM_JOB_ID / $SLURM_JOB_NODELIST for them.
[[ ${SLURM_TEST_SKIP_UP:-0} == 1 ]] && exit 0
echo "test-slurm: up --launcher slurm under salloc -N 3"
HF_HUB_OFFLINE=1 timeout "$TIMEOUT" salloc -N 3 --exclusive --time=20 --job-name=earl-up \
    "$BIN/pytest" -q -p no:cacheprovider -m slurm tests "$@"
