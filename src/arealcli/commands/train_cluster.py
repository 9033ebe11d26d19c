"""`areal train RECIPE --launcher slurm|ray`: place the run on a cluster's nodes (runtime/launchers)."""

from __future__ import annotations

import typer

from arealcli.commands.common import console, err_console, fail, say, say_error, voice
from arealcli.errors import UserError


def launch_cluster(resolved, job, flags) -> None:
    from arealcli.runtime.launchers.plan import export_initial_weights, make_plan, trainer_command
    from arealcli.runtime.run.supervise import check_world, prepare

    try:
        plan = make_plan(resolved, job.run_dir, flags.nnodes, flags.nproc_per_node)
        check_world(resolved, plan.world)
    except UserError as e:
        raise fail(e.lines) from None
    command = trainer_command(job.recipe, job.overrides, job.run_dir, flags.resume, plan)
    if flags.launcher == "slurm":
        from arealcli.runtime.launchers.slurm import SlurmJob, render

        cluster = resolved.cluster
        slurm_job = SlurmJob(
            plan, command, job.run_dir, resolved.experiment, resume_flags=" ".join(job.launch_flags)
        )
        if cluster is not None:
            slurm_job.slurm = cluster.slurm
        if flags.dry_run:
            say(f"dry run: the sbatch script for {job.run_dir} (nothing was written or submitted):")
            console.print(render(slurm_job), markup=False, highlight=False, soft_wrap=True)
            return
    elif flags.dry_run:
        say(f"dry run: a Ray job of {plan.nodes} node(s) for {job.run_dir}; nothing was started")
        for line in plan.describe():
            say(f"  {line}")
        return
    try:
        prepare(resolved, job, flags.overwrite, voice())
    except UserError as e:
        raise fail(e.lines) from None
    if plan.servers:  # the servers start from the weights the trainer would build
        export_initial_weights(resolved, job.recipe, job.run_dir, sorted({s.model for s in plan.servers}))
    if flags.launcher == "slurm":
        _slurm(slurm_job, flags, job)
    else:
        _ray(plan, command, job, flags)


def _slurm(slurm_job, flags, job) -> None:
    from arealcli.runtime.launchers.slurm import follow, submit, trainer_log

    log = trainer_log(job.run_dir)
    offset = log.stat().st_size if log.exists() else 0  # a resumed run's output starts there
    try:
        job_id, script = submit(slurm_job)
    except UserError as e:
        raise fail(e.lines) from None
    logs = job.run_dir / "logs"
    say(f"submitted Slurm job {job_id}: {slurm_job.plan.nodes} node(s); script {script}")
    for line in slurm_job.plan.describe():
        say(f"  {line}")
    say(f"logs: {logs}/ (trainer-R.log by node-rank, MODEL-I.log by server, slurm-{job_id}.out)")
    say(f"cancel: scancel {job_id} (the trainer stops, keeping its last checkpoint)")
    if not flags.wait:
        return
    try:
        state, code = follow(job_id, log, offset, lambda text: console.out(text, end="", highlight=False))
    except KeyboardInterrupt:
        say_error(f"stopped following; job {job_id} goes on (scancel {job_id} to stop it)", title="note")
        raise typer.Exit(130) from None
    if code != 0:
        say_error(f"Slurm job {job_id} ended {state} (exit code {code}); logs in {logs}")
        raise typer.Exit(code)
    say(f"Slurm job {job_id} {state.lower()}: run directory {job.run_dir}")


def _ray(plan, command, job, flags) -> None:
    from arealcli.runtime.launchers.ray import RayJob, run_on_ray

    try:
        code = run_on_ray(
            RayJob(plan, command, job.run_dir, " ".join(job.launch_flags), flags.address),
            lambda text: console.out(text, end="", highlight=False),
            lambda line: say(line, err_console),
        )
    except UserError as e:
        raise fail(e.lines) from None
    if code != 0:
        raise typer.Exit(code)
