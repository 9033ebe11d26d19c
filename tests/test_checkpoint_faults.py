"""Damaged checkpoints and full disks: resume falls back to an intact checkpoint (saying which file was
bad) or stops with exit 2 naming it; a save that runs out of space keeps the previous checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

STEP4, STEP6 = "step_00000004", "step_00000006"


def trained(ws, cli) -> tuple[Path, Path]:
    recipe = ws.recipe(trainer={"max_steps": 6, "save_every_n_steps": 2, "tensorboard": False})
    run = ws.root / "run"
    result = cli("train", recipe, "-o", run)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [STEP4, STEP6]
    return recipe, run


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def zero_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)  # same size, different bytes
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, file, why",
    [
        (truncate, "default/model.safetensors", "has"),
        (zero_middle, "default/model.safetensors", "does not match its checksum"),
        (lambda p: p.unlink(), "default/engine_state.pt", "is missing"),
        (truncate, "trainer_state.pt", "has"),
    ],
    ids=["truncated-weights", "zeroed-weights", "deleted-optimizer", "truncated-trainer-state"],
)
def test_resume_falls_back_past_a_damaged_checkpoint(ws, cli, damage, file, why):
    recipe, run = trained(ws, cli)
    damage(run / "checkpoints" / STEP6 / file)
    result = cli("train", recipe, "-o", run, "--resume", "trainer.max_steps=8")
    assert result.exit_code == 0, result.output
    note = " ".join(result.stderr.split())
    assert f"skipping a damaged checkpoint: {run / 'checkpoints' / STEP6}: {file} {why}" in note, note
    assert "resuming from step_00000004" in note and "(step 4)" in result.stdout
    assert (run / "checkpoints" / f"damaged-{STEP6}").is_dir()  # set aside, not deleted
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step_00000008"


def test_no_usable_checkpoint_is_exit_2_naming_every_file(ws, cli):
    recipe, run = trained(ws, cli)
    truncate(run / "checkpoints" / STEP6 / "trainer_state.pt")
    (run / "checkpoints" / STEP4 / "default" / "engine_state.pt").unlink()
    result = cli("train", recipe, "-o", run, "--resume", "trainer.max_steps=8")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "no usable checkpoint" in result.stderr
    assert f"{STEP6}: trainer_state.pt has" in result.stderr
    assert f"{STEP4}: default/engine_state.pt is missing" in result.stderr


def test_a_checkpoint_without_manifest_that_fails_to_load_names_the_file(ws, cli):
    recipe, run = trained(ws, cli)
    for step in (STEP4, STEP6):  # as written before manifests existed
        (run / "checkpoints" / step / "manifest.json").unlink()
    truncate(run / "checkpoints" / STEP6 / "default" / "model.safetensors")
    result = cli("train", recipe, "-o", run, "--resume", "trainer.max_steps=8")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"cannot load {run / 'checkpoints' / STEP6 / 'default'}" in result.stderr


def test_manifest_lists_every_file(ws, cli):
    _, run = trained(ws, cli)
    manifest = json.loads((run / "checkpoints" / STEP6 / "manifest.json").read_text())["files"]
    on_disk = {
        str(p.relative_to(run / "checkpoints" / STEP6))
        for p in (run / "checkpoints" / STEP6).rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert set(manifest) == on_disk and {"trainer_state.pt", "default/model.safetensors"} <= on_disk


@pytest.fixture
def small_disk(tmp_path):
    """A real, small file system (tmpfs); skipped where mounting is not allowed."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()

    def make(size_kb: int) -> Path:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mount)], capture_output=True
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        return mount

    yield make
    if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)  # whatever still holds it


def test_disk_full_during_a_save(ws, cli, small_disk):
    recipe = ws.recipe(trainer={"max_steps": 6, "save_every_n_steps": 2, "tensorboard": False})
    probe = ws.root / "probe"
    assert cli("train", recipe, "-o", probe, "trainer.max_steps=2").exit_code == 0
    one = sum(p.stat().st_size for p in (probe / "checkpoints" / "step_00000002").rglob("*") if p.is_file())
    # room for the run directory and one checkpoint and a half: the second save runs out of space
    disk = small_disk(int(one * 1.5) // 1024 + 64)
    run = disk / "run"
    result = cli("train", recipe, "-o", run)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert f"no space left on {disk}" in result.stderr
    assert "step_00000002 is kept" in " ".join(result.stderr.split())
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["LATEST", "step_00000002"]  # no .tmp-*
    shutil.rmtree(run)
