"""Nobody gets in: keys on `areal serve` (real HTTP), launched servers keyed per run without the key on
any command line, weight updates only from the run's folder, checkpoints that cannot run code."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from typer.testing import CliRunner

from arealcli.main import app
from arealcli.runtime.run.checkpoint import write_manifest
from tests.conftest import REPO, train_until_crash

API, ADMIN = "plain-key-123", "admin-key-456"


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    """`areal serve` with an API key and an admin key, both from the environment."""
    log = tmp_path_factory.mktemp("keyed") / "serve.log"
    env = {**os.environ, "AREAL_API_KEY": API, "AREAL_ADMIN_KEY": ADMIN}
    cmd = [sys.executable, "-m", "arealcli.main", "serve", "--model", str(model_dir), "--port", "0"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 90
    while "at http://" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    url = log.read_text().split("at http://", 1)[1].split()[0]
    yield f"http://{url}", proc, log
    proc.terminate()
    proc.wait(10)


def call(url: str, path: str, key: str | None = None, body=None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is None and path in ("/health", "/v1/models", "/get_model_info"):
        return httpx.get(url + path, headers=headers, timeout=30, trust_env=False)
    return httpx.post(url + path, json=body or {}, headers=headers, timeout=30, trust_env=False)


def test_keys_guard_every_endpoint_but_health(keyed, model_dir):
    url, _, log = keyed
    generate = {"input_ids": [20, 21], "sampling_params": {"max_new_tokens": 2}}
    assert call(url, "/health").status_code == 200  # liveness probes need no key
    for path, body in [("/generate", generate), ("/v1/models", None), ("/get_model_info", None)]:
        assert call(url, path, body=body).status_code == 401
        assert call(url, path, "wrong", body=body).status_code == 401
        assert call(url, path, API, body=body).status_code == 200
    update = {"model_path": str(model_dir), "weight_version": "2"}
    for path, body in [("/update_weights_from_disk", update), ("/abort_request", {"abort_all": True})]:
        assert call(url, path, body=body).status_code == 401
        r = call(url, path, API, body=body)
        assert r.status_code == 403 and "admin key" in r.json()["error"]["message"]
        assert call(url, path, ADMIN, body=body).status_code == 200
    assert API not in log.read_text() and ADMIN not in log.read_text()  # refusals logged without keys
    assert "401 /generate" in log.read_text()


def test_a_reachable_address_without_a_key_is_refused(model_dir):
    result = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--host", "0.0.0.0"], env={})
    assert result.exit_code == 2 and "--allow-unauthenticated" in result.output, result.output


def test_a_training_run_keys_its_launched_server_and_no_command_line_shows_it(tmp_path):
    """The quickstart with a launched embedded server: its key is in the server's environment, on no
    process's command line; the server refuses requests without it, and weight updates from elsewhere."""
    run_dir = tmp_path / "run"
    args = [
        "trainer.max_steps=8",
        "dataflow.sft_warmup_steps=2",
        "trainer.eval_every_n_steps=null",
        "trainer.eval_at_start=false",
        "trainer.tensorboard=false",
        "trainer.save_every_n_steps=null",
    ]
    cmd = [
        sys.executable,
        "-m",
        "arealcli.main",
        "train",
        str(REPO / "recipes" / "quickstart-server.yaml"),
        "-o",
        str(run_dir),
        *args,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        pids: list[str] = []
        while not pids:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            found = subprocess.run(
                ["pgrep", "-f", f"serve --model {run_dir}"], capture_output=True, text=True
            )
            pids = found.stdout.split()
            time.sleep(0.1)
        environ = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
        key = next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"AREAL_API_KEY="))
        assert len(key) >= 32
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert key not in ps
        argv = Path(f"/proc/{pids[0]}/cmdline").read_bytes().decode().split("\0")
        address = f"{argv[argv.index('--host') + 1]}:{argv[argv.index('--port') + 1]}"
        while True:
            try:
                if call(f"http://{address}", "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert call(f"http://{address}", "/v1/models").status_code == 401
        elsewhere = {"model_path": str(tmp_path), "weight_version": "9"}
        r = call(f"http://{address}", "/update_weights_from_disk", key, elsewhere)
        assert r.status_code == 403 and "only from below" in r.json()["message"]
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out


class Payload:
    """What a crafted checkpoint would hide: loading it with pickle runs `touch MARKER`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_trainer_state_that_would_run_code_is_refused_and_does_not_run(ws, tmp_path):
    recipe = ws.recipe(trainer={"max_steps": 6, "save_every_n_steps": 2, "tensorboard": False})
    run_dir = ws.root / "run"
    train_until_crash(recipe, run_dir, 5)
    step = run_dir / "checkpoints" / "step_00000004"
    marker = tmp_path / "pwned"
    state = torch.load(step / "trainer_state.pt", weights_only=True)
    state["rng"] = Payload(marker)
    with open(step / "trainer_state.pt", "wb") as f:
        pickle.dump(state, f)  # what torch.save would write for it too: a pickle
    write_manifest(step)  # whoever writes the file can write the manifest
    result = CliRunner().invoke(app, ["train", str(recipe), "-o", str(run_dir), "--resume"])
    assert result.exit_code == 2, result.output
    assert "refusing to load" in result.output and "trainer_state.pt" in result.output
    assert not marker.exists()  # the payload never ran
