"""`areal train RECIPE --launcher slurm`: one sbatch script that runs the whole job.

The script (written to RUN/launch/slurm.sh, printed by `--dry-run`):
1. lists the job's nodes (`scontrol show hostnames`) and their addresses (`NodeAddr`);
2. makes the servers' key (in the job, never on a command line or in the script);
3. starts each generation server of `cluster.allocation` as its own job step (`srun --nodes=1
   --nodelist=NODE`), on a port derived from the job id (or the backend's `base_port`), from the
   submitter's environment without its key variables (AREAL_*, VLLM_API_KEY: a shell's AREAL_ADMIN_KEY
   would make the run's weight updates fail) plus the job's key, and waits until each answers /health
   with the proof of that key (launchers/health);
4. starts the trainer as one step over the trainer nodes, one task per node, each running
   `areal train --nnodes K --node-rank $SLURM_PROCID` (torch's elastic agent with `--nproc-per-node`
   ranks), rendezvous on the first trainer node, the servers' addresses in its environment;
5. before the time limit (`--signal=B:USR1@stop_grace_s`) sends SIGTERM to the trainer's tasks
   (`scancel --signal=TERM JOB.STEP`: a SIGTERM to srun would kill them at once); `scancel JOB` sends
   SIGTERM to every step itself. The trainer stops cleanly, keeping its last checkpoint and printing
   the command that continues; then the script stops the servers and exits with the trainer's code.
Each process logs under RUN/logs/: `trainer-R.log` (trainer node-rank R), `MODEL-I.log` (server I of
MODEL), the script itself to `slurm-JOBID.out`. The run directory must be on a file system every node
sees (weight updates go through it).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from arealcli.errors import UserError
from arealcli.runtime.launchers.plan import HOST, PORT, ClusterPlan, ServerTask, areal_command
from arealcli.runtime.run.launch import PREPARED_ENV, RESUME_FLAGS_ENV
from arealcli.runtime.run.session import SERVERS_ENV
from arealcli.runtime.wire.auth import CLUSTER_KEY_ENV, VLLM_API_KEY_ENV
from arealcli.schema.recipe import SlurmSpec

SCRIPT = Path("launch") / "slurm.sh"
MASTER_PORT_OFFSET = 999  # the rendezvous port: the job's port base plus this


@dataclass
class SlurmJob:
    plan: ClusterPlan
    trainer_command: list[str]  # `areal train ...` without the node's rank and the rendezvous
    run_dir: Path
    experiment: str
    slurm: SlurmSpec = field(default_factory=SlurmSpec)
    resume_flags: str = ""  # the launcher's own flags, for the command a stopped run prints
    workdir: Path = field(default_factory=Path.cwd)


def _q(word: str) -> str:
    return shlex.quote(word)


def _sbatch_lines(job: SlurmJob) -> list[str]:
    p, s = job.plan, job.slurm
    logs = job.run_dir.resolve() / "logs"
    lines = [
        f"--job-name=areal-{job.experiment}",
        f"--nodes={p.nodes}",
        "--ntasks-per-node=1",
    ]
    if p.cpus_per_node:
        lines.append(f"--cpus-per-task={p.cpus_per_node}")
    if p.gpus_per_node:
        lines.append(f"--gpus-per-node={p.gpus_per_node}")
    for flag, value in (("partition", s.partition), ("account", s.account), ("time", s.time)):
        if value:
            lines.append(f"--{flag}={value}")
    lines += [f"--output={logs}/slurm-%j.out", f"--signal=B:USR1@{s.stop_grace_s}", *s.sbatch_args]
    return [f"#SBATCH {line}" for line in lines]


def _server_step(task: ServerTask, plan: ClusterPlan) -> list[str]:
    """The lines that start one server as a job step, in the background."""
    var = f"{re.sub(r'[^A-Za-z0-9]', '_', task.model).upper()}_{task.index}"
    port = str(task.port) if task.port is not None else f"$((PORT_BASE + {plan.servers.index(task)}))"
    inner = " ".join('"$0"' if w == HOST else '"$1"' if w == PORT else _q(w) for w in task.command)
    env = " ".join(f"{k}={_q(v)}" for k, v in task.env.items())
    # inherited key variables out (as clients/launcher.child_env does), the job's key in under the
    # server's own variable; the cluster key's own variable goes too
    unset = f'unset "${{!AREAL_@}}" {VLLM_API_KEY_ENV}'
    body = f'{unset}; export {task.key_env}="${CLUSTER_KEY_ENV}" {env}; unset {CLUSTER_KEY_ENV}; exec {inner}'
    cpus = plan.cpus_per_node // len(plan.servers_on(task.node)) if plan.cpus_per_node else None
    flags = [
        "--nodes=1",
        "--ntasks=1",
        f'--nodelist="${{NODES[{task.node}]}}"',
        "--overlap",
        f'--output="$RUN/logs/{task.name}.log"',
        "--open-mode=append",  # a resumed run's log follows the first's
    ]
    if cpus:
        flags.append(f"--cpus-per-task={max(1, cpus)}")
    if task.gpus:
        flags.append(f"--gpus={task.gpus}")
    return [
        f"# {task.model} server {task.index} ({task.kind}) on node {task.node}",
        f'HOST_{var}=$(node_addr "${{NODES[{task.node}]}}"); PORT_{var}={port}',
        f"srun {' '.join(flags)} \\",
        f'    bash -c {_q(body)} "$HOST_{var}" "$PORT_{var}" &',
        f'SERVER_PIDS+=($!); SERVER_ADDRS+=("{task.model}=$HOST_{var}:$PORT_{var}")',
    ]


def render(job: SlurmJob) -> str:
    """The sbatch script of `job`."""
    p = job.plan
    run = str(job.run_dir.resolve())
    python = areal_command()[0]
    first = p.trainer_nodes[0]
    trainer_nodes = ",".join(f"${{NODES[{n}]}}" for n in p.trainer_nodes)
    inner = " ".join(_q(w) for w in job.trainer_command)
    inner += ' --node-rank="$SLURM_PROCID" --master-addr="$0" --master-port="$1"'
    trainer_flags = [
        "--job-name=areal-trainer",
        f"--nodes={len(p.trainer_nodes)}",
        f"--ntasks={len(p.trainer_nodes)}",
        "--ntasks-per-node=1",
        f'--nodelist="{trainer_nodes}"',
        "--overlap",
        "--kill-on-bad-exit=1",
        '--output="$RUN/logs/trainer-%t.log"',  # by node-rank
        "--open-mode=append",
    ]
    if p.cpus_per_node:
        trainer_flags.append(f"--cpus-per-task={p.cpus_per_node}")
    if p.gpus_per_node:
        trainer_flags.append(f"--gpus-per-node={p.gpus_per_node}")
    out = [
        "#!/bin/bash",
        f"# Written by `areal train --launcher slurm` for run {run}:",
        *[f"#   {line}" for line in p.describe()],
        *_sbatch_lines(job),
        "set -u",
        *job.slurm.setup,
        f"cd {_q(str(job.workdir.resolve()))}",
        f"RUN={_q(run)}",
        f"PY={_q(python)}",
        f"export {PREPARED_ENV}=1 {RESUME_FLAGS_ENV}={_q(job.resume_flags)}",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "node_addr() { scontrol show node \"$1\" -o | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p'; }",
        f"{CLUSTER_KEY_ENV}=$(\"$PY\" -c 'import secrets; print(secrets.token_urlsafe(32))')",
        f"export {CLUSTER_KEY_ENV}",
        "PORT_BASE=$((20000 + SLURM_JOB_ID % 20000))",
        "SERVER_PIDS=(); SERVER_ADDRS=()",
        'stop_servers() { [ ${#SERVER_PIDS[@]} -eq 0 ] || kill -TERM "${SERVER_PIDS[@]}" 2>/dev/null; wait; }',
        "",
    ]
    for task in p.servers:
        out += _server_step(task, p) + [""]
    if p.servers:  # every server answers /health, else stop; the trainer gets {model: [addresses]}
        out += [
            f'{SERVERS_ENV}=$("$PY" -m arealcli.runtime.launchers.health --timeout 600 \\',
            '    ${SERVER_PIDS[@]/#/--pid=} "${SERVER_ADDRS[@]}") || { stop_servers; exit 1; }',
            f"export {SERVERS_ENV}",
            "",
        ]
    out += [
        f"# the trainer: node-rank r on trainer node r, rendezvous on node {first}",
        f'MASTER_ADDR=$(node_addr "${{NODES[{first}]}}"); MASTER_PORT=$((PORT_BASE + {MASTER_PORT_OFFSET}))',
        f"srun {' '.join(trainer_flags)} \\",
        f'    bash -c {_q("exec " + inner)} "$MASTER_ADDR" "$MASTER_PORT" &',
        "TRAINER=$!",
        "# Before the time limit Slurm sends this script USR1 (sbatch --signal): SIGTERM to the trainer's",
        "# tasks (not to srun, which would kill them at once). `scancel` sends SIGTERM to every step itself.",
        "trainer_step() { squeue -h -s -j \"$SLURM_JOB_ID\" -o '%i %j' | awk '$2 == \"areal-trainer\" {print $1}'; }",
        "trap 'scancel --signal=TERM \"$(trainer_step)\" 2>/dev/null' USR1",
        "trap 'echo \"areal: SIGTERM: waiting for the trainer to stop\" >&2' TERM",
        "while :; do wait $TRAINER; CODE=$?; kill -0 $TRAINER 2>/dev/null || break; done",
        "stop_servers",
        "exit $CODE",
        "",
    ]
    return "\n".join(out)


def submit(job: SlurmJob) -> tuple[str, Path]:
    """Write the script into the run directory and submit it; returns (job id, script path)."""
    if shutil.which("sbatch") is None:
        raise UserError("--launcher slurm: `sbatch` is not on PATH (run this on a Slurm login node)")
    path = job.run_dir / SCRIPT
    path.parent.mkdir(parents=True, exist_ok=True)
    (job.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path.write_text(render(job))
    path.chmod(0o755)
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0], path


def job_state(job_id: str) -> tuple[str, int | None]:
    """(state, exit code once it ended) from `scontrol show job` (a signal's n as 128+n)."""
    done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    fields = dict(f.split("=", 1) for f in done.stdout.split() if "=" in f)
    state = fields.get("JobState", "UNKNOWN")
    if state in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "UNKNOWN"):
        return state, None
    code, _, signal = fields.get("ExitCode", "1:0").partition(":")
    if signal not in ("", "0"):
        return state, 128 + int(signal)
    return state, int(code) if code.isdigit() else 1


def trainer_log(run_dir: Path) -> Path:
    """The log of trainer node-rank 0 (every job of the run appends to it)."""
    return run_dir / "logs" / "trainer-0.log"


def follow(job_id: str, log: Path, offset: int, echo, poll_s: float = 1.0) -> tuple[str, int]:
    """Print `log` from `offset` on as it grows, until the job ends; (state, exit code)."""
    while True:
        state, code = job_state(job_id)
        if log.exists():
            with open(log, errors="replace") as f:
                f.seek(offset)
                text = f.read()
                offset = f.tell()
            if text:
                echo(text)
        if code is not None:
            return state, code
        time.sleep(poll_s)
