"""`areal train --launcher slurm|ray`: the run placed on a cluster's nodes. The plan and the batch size
checked, then (dry run) the sbatch script or the Ray placement said, or the run directory prepared as a
local run's (runtime/run/supervise.py), the servers' initial weights exported, and the job submitted.
Each trainer node runs `areal train` again and supervises itself. Messages go through the `Voice`; an
exit code is a `RunEnded`, bad input a `UserError`."""

from __future__ import annotations

from arealcli.runtime.run.supervise import (
    ClusterFlags,
    Invocation,
    RunEnded,
    Voice,
    check_dry,
    check_world,
    prepare,
)


def start(recipe, job: Invocation, flags: ClusterFlags, voice: Voice) -> None:
    """Plan, check, and (dry run) say, or prepare and submit the job."""
    from arealcli.runtime.launchers.plan import export_initial_weights, make_plan, trainer_command

    plan = make_plan(recipe, job.run_dir, flags.nnodes, flags.nproc_per_node)
    check_world(recipe, plan.world)
    command = trainer_command(job.recipe, job.overrides, job.run_dir, job.resumed, plan)
    slurm_job = _slurm_job(recipe, job, plan, command) if flags.launcher == "slurm" else None
    if job.dry_run:  # the run directory checked as a run would check it, then the job said
        check_dry(recipe, job, voice)
        return _dry_run(slurm_job, plan, job, voice)
    prepare(recipe, job, voice)
    if plan.servers:  # the servers start from the weights the trainer would build
        export_initial_weights(recipe, job.recipe, job.run_dir, sorted({s.model for s in plan.servers}))
    if slurm_job is not None:
        _slurm(slurm_job, flags, job, voice)
    else:
        _ray(plan, command, job, flags, voice)


def _slurm_job(recipe, job: Invocation, plan, command):
    from arealcli.runtime.launchers.slurm import SlurmJob

    slurm_job = SlurmJob(
        plan, command, job.run_dir, recipe.experiment, resume_flags=" ".join(job.launch_flags)
    )
    if recipe.cluster is not None:
        slurm_job.slurm = recipe.cluster.slurm
    return slurm_job


def _dry_run(slurm_job, plan, job: Invocation, voice: Voice) -> None:
    """The sbatch script, or what a Ray job would run where; nothing written, submitted or started."""
    if slurm_job is not None:
        from arealcli.runtime.launchers.slurm import render

        voice.say(f"dry run: the sbatch script for {job.run_dir} (nothing was written or submitted):")
        voice.console.print(render(slurm_job), markup=False, highlight=False, soft_wrap=True)
        return
    voice.say(f"dry run: a Ray job of {plan.nodes} node(s) for {job.run_dir}; nothing was started")
    for line in plan.describe():
        voice.say(f"  {line}")


def _slurm(slurm_job, flags: ClusterFlags, job: Invocation, voice: Voice) -> None:
    """Submit; say where the logs go and how to cancel; with --wait follow the trainer's log to the end."""
    from arealcli.runtime.launchers.slurm import follow, submit, trainer_log

    log = trainer_log(job.run_dir)
    offset = log.stat().st_size if log.exists() else 0  # a resumed run's output starts there
    job_id, script = submit(slurm_job)
    logs = job.run_dir / "logs"
    voice.say(f"submitted Slurm job {job_id}: {slurm_job.plan.nodes} node(s); script {script}")
    for line in slurm_job.plan.describe():
        voice.say(f"  {line}")
    voice.say(f"logs: {logs}/ (trainer-R.log by node-rank, MODEL-I.log by server, slurm-{job_id}.out)")
    voice.say(f"cancel: scancel {job_id} (the trainer stops, keeping its last checkpoint)")
    if not flags.wait:
        return
    try:
        state, code = follow(
            job_id, log, offset, lambda text: voice.console.out(text, end="", highlight=False)
        )
    except KeyboardInterrupt:
        voice.note(f"stopped following; job {job_id} goes on (scancel {job_id} to stop it)")
        raise RunEnded(130) from None
    if code != 0:
        voice.error(f"Slurm job {job_id} ended {state} (exit code {code}); logs in {logs}")
        raise RunEnded(code)
    voice.say(f"Slurm job {job_id} {state.lower()}: run directory {job.run_dir}")


def _ray(plan, command, job: Invocation, flags: ClusterFlags, voice: Voice) -> None:
    """Run the job on the Ray cluster, its output shown as it comes; its exit code the command's."""
    from arealcli.runtime.launchers.ray import RayJob, run_on_ray

    code = run_on_ray(
        RayJob(plan, command, job.run_dir, " ".join(job.launch_flags), flags.address),
        lambda text: voice.console.out(text, end="", highlight=False),
        lambda line: voice.error(line, title=""),
    )
    if code != 0:
        raise RunEnded(code)
