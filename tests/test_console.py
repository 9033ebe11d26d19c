"""What a user sees: the header, the progress lines (log file and real terminal), the end-of-run summary,
report.png and `areal report`, trackers."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

PNG = b"\x89PNG\r\n\x1a\n"


def test_log_file_output_header_lines_summary_and_report(ws, cli):
    recipe = ws.recipe(
        eval_dataset={"type_": "prompt_answer", "args": {"path": "test.jsonl"}, "batch_size": 8},
        trainer={"max_steps": 6, "log_every_n_steps": 2, "eval_every_n_steps": 3, "tensorboard": True},
    )
    run = ws.root / "run"
    result = cli("train", recipe, "-o", run)
    assert result.exit_code == 0, result.output
    out = result.stdout
    for label in ("experiment", "run dir", "models", "dataflow", "steps"):
        assert re.search(rf"^{label}\s+\S", out, re.M), label
    assert "default (qwen2 32x2 from config; hf)" in out and "6 steps, eval every 3" in out
    steps = re.findall(r"^step (\d+)/6 \[(\d+:\d\d) < (\d+:\d\d)\] (.*)$", out, re.M)
    assert [int(s[0]) for s in steps] == [2, 4, 6]  # one line per logged step, never wrapped
    assert "held-out nll=" in steps[1][3] and "loss=" in steps[1][3]
    assert "held-out nll=" in steps[0][3] or "held-out" not in steps[0][3]
    assert re.search(r"^held-out\s+(sft/)?nll: final [\d.]+ \(step 6\), best [\d.]+ \(step \d\)", out, re.M)
    assert f"checkpoint  {run / 'checkpoints' / 'step_00000006'}" in out
    assert (run / "report.png").read_bytes()[:8] == PNG and (run / "report.png").stat().st_size > 20_000
    assert any((run / "tensorboard").iterdir())  # installed with the package: events are written


def test_real_terminal_keeps_step_count_and_time(ws):
    """In a terminal (a pty, 140 columns) the progress line keeps step/total, elapsed and ETA beside
    the chosen metrics, however many metrics the run logs."""
    recipe = ws.recipe(trainer={"max_steps": 12, "tensorboard": False})
    env = {**os.environ, "COLUMNS": "140", "LINES": "40", "TERM": "xterm-256color"}
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "arealcli.main", "train", str(recipe), "-o", str(ws.root / "run")],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        close_fds=True,
    )
    os.close(slave)
    chunks = []
    deadline = time.time() + 120
    while time.time() < deadline:
        r, _, _ = select.select([master], [], [], 0.5)
        if r:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    screen = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", b"".join(chunks)).decode(errors="replace")
    assert proc.returncode == 0, screen[-2000:]
    assert "12/12" in screen and "loss=" in screen
    assert re.search(r"12/12 \d+:\d\d(:\d\d)? < \d+:\d\d", screen), screen[-1500:]
    assert "experiment" in screen and "done: 12 steps" in screen


def test_areal_report_overlays_runs(ws, cli, tmp_path):
    runs = []
    for lr in (0.01, 0.05):
        recipe = ws.recipe(f"r{lr}.yaml", trainer={"max_steps": 4, "tensorboard": False})
        run = ws.root / f"run-{lr}"
        assert (
            cli("train", recipe, "-o", run, f"models.default.backend.args.optimizer.lr={lr}").exit_code == 0
        )
        runs.append(run)
    out = tmp_path / "both.png"
    result = cli("report", *runs, "-o", out, "--label", "slow", "--label", "fast")
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == PNG
    assert all(str(r) in result.stdout for r in runs) and f"report  {out}" in result.stdout
    result = cli("report", ws.root / "nothing-here")
    assert result.exit_code == 2 and "no metrics.jsonl" in result.stderr


def test_wandb_offline(ws, cli, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = ws.recipe(
        trainer={"max_steps": 3, "tensorboard": False, "wandb": {"mode": "offline", "project": "t"}}
    )
    run = ws.root / "run"
    result = cli("train", recipe, "-o", run)
    assert result.exit_code == 0, result.output
    (offline,) = (run / "wandb").glob("offline-run-*")
    assert any(offline.rglob("*.wandb"))  # the run's history, for `wandb sync`


def test_readme_quickstart_report_exists_in_shipped_docs():
    """The README tells where the picture is and how to redraw it."""
    text = (REPO / "README.md").read_text()
    assert "report.png" in text and "areal report" in text


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
