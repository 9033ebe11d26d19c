"""Interrupts and resume that tell the truth: Ctrl-C in a terminal ends the live line, then says which
checkpoint is kept and the exact command that continues the run; a resumed run's summary counts this
session's steps; resuming a finished run does nothing and says so."""

from __future__ import annotations

import os
import pty
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from arealcli.runtime.run.supervise import Invocation


def test_the_continue_command_is_the_shortest_that_is_right(tmp_path):
    recipe, default = Path("recipes/sft-quickstart.yaml"), Path("runs/sft-quickstart")
    plain = Invocation(recipe, [], default, default)
    assert plain.resume_command() == "areal train recipes/sft-quickstart.yaml --resume"
    # the case: started with -o and an override; the run's own recipe holds the override
    changed = Invocation(recipe, ["trainer.total_train_epochs=40"], Path("runs/sft-resume"), default)
    assert changed.resume_command() == "areal train runs/sft-resume/recipe.yaml --resume -o runs/sft-resume"
    assert changed.restart_command() == (
        "areal train recipes/sft-quickstart.yaml trainer.total_train_epochs=40 -o runs/sft-resume --overwrite"
    )
    # a resumed run that lengthened itself: its override is not in the run's recipe, so it is repeated
    longer = Invocation(recipe, ["trainer.max_steps=300"], default, default, resumed=True)
    assert longer.resume_command() == "areal train recipes/sft-quickstart.yaml trainer.max_steps=300 --resume"
    spaced = Invocation(recipe, [], Path("my runs/a"), default, ["--nproc-per-node=2"])
    assert shlex.split(spaced.resume_command()) == [
        "areal", "train", "my runs/a/recipe.yaml", "--resume", "-o", "my runs/a", "--nproc-per-node=2",
    ]  # fmt: skip


def read_until(fd: int, proc: subprocess.Popen, done, timeout: float = 120) -> bytes:
    chunks: list[bytes] = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
            if done(b"".join(chunks)):
                break
        elif proc.poll() is not None:
            break
    return b"".join(chunks)


def screen_text(raw: bytes) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode(errors="replace")).replace("\r", "\n")


def test_ctrl_c_in_a_terminal_says_what_is_kept_and_how_to_continue(ws):
    ws.recipe(trainer={"max_steps": 100000, "save_every_n_steps": 2, "tensorboard": False})  # recipe.yaml
    run = ws.root / "run"
    env = {**os.environ, "COLUMNS": "80", "LINES": "30", "TERM": "xterm-256color"}
    master, slave = pty.openpty()
    cmd = [sys.executable, "-m", "arealcli.main", "train", "recipe.yaml", "-o", "run"]
    proc = subprocess.Popen(
        cmd, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ws.root, close_fds=True
    )
    os.close(slave)
    try:
        latest = run / "checkpoints" / "LATEST"
        before = read_until(master, proc, lambda _: latest.exists() and latest.read_text() >= "step_00000004")
        proc.send_signal(signal.SIGINT)
        after = read_until(master, proc, lambda _: proc.poll() is not None, timeout=60)
        proc.wait(timeout=30)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    text = screen_text(before + after)
    kept = re.search(r"interrupted: the last complete checkpoint is kept: step (\d+),\s+(\S+)", text)
    assert kept, text[-2000:]
    step, path = int(kept.group(1)), kept.group(2)
    assert path == f"run/checkpoints/step_{step:08d}" and (ws.root / path).is_dir()
    tail = text[kept.end() :]
    assert re.match(r"\s*continue with: areal train run/recipe.yaml --resume -o run\n", tail), tail
    assert not re.search(r"\d+/100000", tail)  # no progress line after the message
    assert "Traceback" not in text

    # the command as printed continues this run (checked without training: --dry-run)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "arealcli.main",
            "train",
            "run/recipe.yaml",
            "--resume",
            "-o",
            "run",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        cwd=ws.root,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "dry run: would resume run and train tiny-sft" in done.stdout


def test_resume_counts_this_session_and_a_finished_run_is_left_alone(ws, cli):
    recipe = ws.recipe(trainer={"max_steps": 4, "save_every_n_steps": 2, "tensorboard": False})
    run = ws.root / "run"
    first = cli("train", recipe, "-o", run)
    assert first.exit_code == 0, first.output
    assert re.search(r"^time\s+4 steps in \d+:\d\d \(", first.stdout, re.M)
    assert "this session" not in first.stdout

    files = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (run / "metrics.jsonl", run / "report.png")}
    again = cli("train", recipe, "-o", run, "--resume")
    assert again.exit_code == 0, again.output
    assert f"nothing to do: {run} has already trained all 4 steps" in again.stdout
    assert "done:" not in again.stdout and "step 1/" not in again.stdout
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files} == files  # nothing rewritten

    longer = cli("train", recipe, "-o", run, "--resume", "trainer.max_steps=6")
    assert longer.exit_code == 0, longer.output
    assert "done: 2 steps" in longer.stdout
    assert re.search(r"^time\s+2 steps in \d+:\d\d this session \(.*\); run total 6$", longer.stdout, re.M)
