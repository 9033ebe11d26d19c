"""Every command through a real subprocess of the installed `areal` console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def areal_command() -> list[str]:
    script = Path(sys.executable).parent / "areal"  # the venv running the tests
    if script.exists():
        return [str(script)]
    found = shutil.which("areal")
    return [found] if found else [sys.executable, "-m", "arealcli.main"]


def areal(*args, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "COLUMNS": "200"}
    return subprocess.run(
        [*areal_command(), *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def test_check_ok_and_failing(ws):
    out = areal("check", REPO / "recipes" / "sft-quickstart.yaml")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")

    bad = ws.recipe("bad.yaml", seeed=2)
    out = areal("check", bad)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert f"{bad}:" in out.stderr and "did you mean 'seed'" in out.stderr
    assert out.stdout == ""


def test_module_entry_point_works_too(ws):
    out = subprocess.run(
        [sys.executable, "-m", "arealcli.main", "check", ws.recipe()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


def test_list_json():
    out = areal("list", "--json")
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert {"interfaces", "backends", "datasets", "rewards"} <= set(payload)
    assert "sft" in [e["name"] for e in payload["interfaces"]]
    assert "hf" in [e["name"] for e in payload["backends"]]
    out = areal("list", "nonsense")
    assert out.returncode == 2


def test_train_three_steps(ws):
    recipe = ws.recipe(trainer={"max_steps": 3, "save_every_n_steps": 2})
    run = ws.root / "run"
    out = areal("train", recipe, "-o", run)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "done" in out.stdout and "3 steps" in out.stdout
    assert "Traceback" not in out.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (run / "recipe.yaml").exists()
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step_00000003"
    assert list((run / "checkpoints" / "step_00000003" / "default").glob("*.safetensors"))

    again = areal("train", recipe, "-o", run)
    assert again.returncode == 2
    assert "already exists" in again.stderr
