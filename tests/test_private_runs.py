"""Private by default: what `areal train` writes is its user's alone (the run directory 0700, its files
0600) unless `trainer.permissions: group` shares it read-only with the group; resume goes on (and makes
an older, open run directory private); an exported model card names no local absolute path, host or
address; `areal chat URL` sends AREAL_API_KEY to this machine only, unless told (`--send-key`)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from arealcli.runtime.run.model_card import public_command, public_recipe
from arealcli.runtime.serve.chat import is_loopback_host, key_for

TRAINER = {"max_steps": 2, "save_every_n_steps": 1, "tensorboard": False}


def modes(root: Path) -> dict[str, int]:
    """Permission bits of the run directory and of everything in it, by path relative to it."""
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        if not path.is_symlink():
            out[path.relative_to(root).as_posix()] = stat.S_IMODE(path.stat().st_mode)
    return out


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_new_run_directory_and_everything_in_it_is_private(ws, cli):
    before = current_umask()
    os.umask(0o022)  # the common default, which leaves files world-readable
    try:
        result = cli("train", ws.recipe(trainer=TRAINER), "-o", ws.root / "runs" / "run")
        assert result.exit_code == 0, result.output
        assert current_umask() == 0o022  # the caller's umask is back (an in-process call)
    finally:
        os.umask(before)
    run = ws.root / "runs" / "run"
    found = modes(run)
    assert found["."] == 0o700
    for name in (
        "recipe.yaml",
        "commands.log",
        "metrics.jsonl",
        "checkpoints/step_00000002/default/model.safetensors",
    ):
        assert found[name] == 0o600, name
    assert found["checkpoints"] == 0o700
    open_to_others = {name: oct(mode) for name, mode in found.items() if mode & 0o077}
    assert open_to_others == {}


def test_group_permissions_share_the_run_read_only_with_the_group(ws, cli):
    before = os.umask(0o002)  # a team's umask (group-writable) is narrowed to group-read
    try:
        result = cli("train", ws.recipe(trainer=TRAINER), "-o", ws.root / "run", "trainer.permissions=group")
        assert result.exit_code == 0, result.output
    finally:
        os.umask(before)
    found = modes(ws.root / "run")
    assert found["."] == 0o750
    assert found["recipe.yaml"] == 0o640 and found["checkpoints"] == 0o750
    assert {
        name: oct(m) for name, m in found.items() if m & 0o027
    } == {}  # no group write, nothing for others
    assert yaml.safe_load((ws.root / "run" / "recipe.yaml").read_text())["trainer"]["permissions"] == "group"


def test_resume_goes_on_and_makes_an_older_open_run_directory_private(ws, cli):
    run = ws.root / "run"
    recipe = ws.recipe(trainer=TRAINER)
    assert cli("train", recipe, "-o", run).exit_code == 0
    # a run made before the option: no `permissions` in its recipe, an open directory
    saved = yaml.safe_load((run / "recipe.yaml").read_text())
    del saved["trainer"]["permissions"]
    (run / "recipe.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    run.chmod(0o755)
    result = cli("train", recipe, "-o", run, "--resume", "trainer.max_steps=3")
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
    ]
    # and the setting may change on resume (who reads the files, not what is trained)
    result = cli("train", recipe, "-o", run, "--resume", "trainer.max_steps=4", "trainer.permissions=group")
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(run.stat().st_mode) == 0o750


def test_areal_check_names_a_bad_permissions_value(ws, cli):
    result = cli("check", ws.recipe(trainer={"max_steps": 1, "permissions": "world"}))
    assert result.exit_code == 2
    assert "trainer.permissions" in result.stderr and "'private' or 'group'" in result.stderr


# ------------------------------------------------------------------ the model card


ADDRESS, HOST = "10.9.8.7:30000", "gpu-node-17.cluster.example.org"


def test_an_exported_card_holds_no_absolute_path_or_address(ws, cli, tmp_path, monkeypatch):
    """A real run (its recipe.yaml has absolute data and output paths; commands.log the folder it was
    typed in and an absolute -o); a server address and host name are added to its saved recipe and a
    multi-node command to its commands.log, as a run that connected to servers elsewhere has them."""
    monkeypatch.chdir(ws.root)  # the folder the run is started from
    run = ws.root / "runs" / "tiny"
    assert cli("train", ws.recipe(trainer=TRAINER), "-o", run).exit_code == 0
    saved = yaml.safe_load((run / "recipe.yaml").read_text())
    saved["models"]["default"]["backend"]["args"].update(
        {"addresses": [ADDRESS, f"http://{HOST}:30001"], "host": HOST}
    )
    (run / "recipe.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    with open(run / "commands.log", "a") as f:
        f.write(
            f"2026-01-01T00:00:00  cd {ws.root} && areal train {ws.root}/recipe.yaml -o {run} --resume "
            f"--nnodes=2 --node-rank=0 --master-addr={ADDRESS.split(':')[0]} "
            f"models.default.backend.args.addresses=[{HOST}:1]\n"
        )
    out = tmp_path / "export"
    result = cli("export", run, "-o", out)
    assert result.exit_code == 0, result.output
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"README.md", "recipe.yaml", "config.json", "generation_config.json", "tokenizer.json"} <= set(
        files
    )
    secrets = (str(ws.root), str(tmp_path), ADDRESS.split(":")[0], HOST, "/tmp/", "/root/", "/home/")
    for name, data in files.items():  # every file of the export (json, md, yaml, txt, weights' headers)
        for secret in secrets:
            assert secret.encode() not in data, (name, secret)
    for name in ("README.md", "recipe.yaml"):
        assert b"<address>" in files[name]
    card = files["README.md"].decode().splitlines()
    # the typed commands, relative to the folder they were typed in: as whole lines
    assert "areal train recipe.yaml -o runs/tiny" in card
    resumed = [line for line in card if line.startswith("areal train recipe.yaml -o runs/tiny --resume ")]
    assert len(resumed) == 1 and "models.default.backend.args.addresses=<address>" in resumed[0]
    assert "--master-addr=<address>" in resumed[0].split()
    shown = yaml.safe_load((out / "recipe.yaml").read_text())
    assert shown["dataset"]["args"]["path"] == "train.jsonl"  # relative to the folder the run started from
    assert shown["models"]["default"]["backend"]["args"]["host"] == "<address>"


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        # free text (prompts, templates, stop strings) stays as written
        ("system_prompt", "Answer briefly /no_think", "Answer briefly /no_think"),
        ("system_prompt", "/no_think", "/no_think"),
        ("stop", "</s>", "</s>"),
        ("stop", "/", "/"),
        ("chat_template", "{% for m in messages %}\n/{{ m.role }}: {{ m.content }}{% endfor %}", None),
        ("system_prompt", "Cite https://huggingface.co/datasets/gsm8k/tree/main.", None),
        ("system_prompt", "see https://en.wikipedia.org:443/wiki/Slash", None),
        # but for URLs that name a machine (an address, a name of one label, a private domain), IPv4s
        ("system_prompt", "ask http://gpu-node-17:8000/v1 first", "ask http://<address>/v1 first"),
        ("system_prompt", "ask http://10.1.2.3:8000/v1", "ask http://<address>/v1"),
        ("system_prompt", "ask https://vllm.cluster.internal/v1", "ask https://<address>/v1"),
        ("system_prompt", "ask https://me:secret@huggingface.co/x", "ask https://<address>/x"),
        ("system_prompt", "ask http://127.0.0.1:30000/v1", None),  # (this machine: points nowhere else)
        ("system_prompt", "node 10.9.8.7:30000 is up", "node <address> is up"),
        # local paths: the values of path keys, strings that are a path as a whole, file:// URLs
        ("path", "/srv/alice/data/train.jsonl", "<local>/train.jsonl"),
        ("path", "/x", "<local>/x"),
        ("path", "Qwen/Qwen2.5-0.5B", None),  # a Hub name
        ("output_dir", "~/runs/x", "<local>/x"),
        ("template_file", "/srv/alice/t.jinja", "<local>/t.jinja"),
        ("notes", "/srv/alice/data", "<local>/data"),
        ("notes", "/usr", "<local>/usr"),  # a single name, but it is there
        ("notes", "file:///home/alice/x.jsonl", "file://<local>/x.jsonl"),
        ("extra_args", "--download-dir /home/alice/cache --port=1", "--download-dir <local>/cache --port=1"),
        ("setup", "source /home/alice/venv/bin/activate", "source <local>/activate"),
        # addresses: every host but this machine's
        ("host", "gpu-node-17.cluster.example.org", "<address>"),
        ("host", "0.0.0.0", None),
        ("addresses", "http://gpu.example.org:30001", "http://<address>"),
        ("addresses", "[::1]:30000", None),
        ("sbatch_args", "--nodelist=gpu[1-4]", "--nodelist=<address>"),
    ],
)
def test_what_a_published_recipe_rewrites_and_what_it_leaves(tmp_path, key, value, shown):
    """Only paths and machines' addresses are rewritten: free text that merely has a slash or a public URL
    in it (a prompt's `/no_think`, a stop string, the Hub's address) is published as written."""
    recipe = {"dataset": {"args": {key: value}}}
    assert public_recipe(recipe, tmp_path / "run")["dataset"]["args"][key] == (
        value if shown is None else shown
    )


def test_a_published_command_rewrites_paths_and_addresses_only(tmp_path):
    start, run = tmp_path / "project", tmp_path / "project" / "runs" / "x"
    words = [
        "areal", "train", str(start / "recipe.yaml"), "-o", str(run), "--master-addr", "10.0.0.1",
        "dataset.args.system_prompt=/no_think", "dataset.args.path=/srv/d/train.jsonl",
        "models.a.path=Qwen/Qwen2.5-0.5B", "models.a.backend.args.addresses=[gpu7:1]",
    ]  # fmt: skip
    assert public_command(words, start, run) == (
        "areal train recipe.yaml -o runs/x --master-addr <address> dataset.args.system_prompt=/no_think "
        "dataset.args.path=<local>/train.jsonl models.a.path=Qwen/Qwen2.5-0.5B "
        "models.a.backend.args.addresses=<address>"
    )


# ------------------------------------------------------------------ the key of `areal chat URL`


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("127.255.255.254", True),
        ("localhost", True),
        ("LOCALHOST.", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.1", False),
        ("192.0.2.2", False),
        ("0.0.0.0", False),
        ("::", False),
        ("example.org", False),
        ("localhost.example.org", False),
        ("127.0.0.1.nip.io", False),
        ("", False),
        (None, False),
    ],
)
def test_which_hosts_count_as_this_machine(host, loopback):
    assert is_loopback_host(host) is loopback


def test_the_key_goes_to_loopback_urls_and_elsewhere_only_when_told(monkeypatch):
    monkeypatch.setenv("AREAL_API_KEY", "k-123")
    assert key_for("http://127.0.0.1:30000", False) == "k-123"
    assert key_for("http://[::1]:30000/v1", False) == "k-123"
    assert key_for("https://gpu7.example.org:30000", False) is None
    assert key_for("http://10.0.0.5:30000", False) is None
    assert key_for("http://10.0.0.5:30000", True) == "k-123"


# Run inside a network namespace of the test's own (`unshare --net`): an address that is not loopback
# (192.0.2.2, a documentation address, on that namespace's own interface, which nothing else shares) serves
# an OpenAI-compatible endpoint that records each request's Authorization header (what any server a URL
# names would see), 127.0.0.1 another; `areal ARGS...` runs against them (an argument URL is replaced by
# the first's address, LOOP by the second's).
# Nothing leaves the namespace. Prints one JSON row per command.
NETNS_SCRIPT = r"""
import json, os, subprocess, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

for cmd in ("ip link set lo up", "ip addr add 192.0.2.2/32 dev lo"):
    subprocess.run(cmd.split(), check=True)
seen = []


class Recorder(BaseHTTPRequestHandler):
    def answer(self, body):
        seen.append(self.headers.get("Authorization"))
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer({"data": [{"id": "m"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        choice = {"message": {"content": "hello"}, "text": "hello", "finish_reason": "stop"}
        choices = [{**choice, "index": i, "token_ids": [1]} for i in range(body.get("n", 1))]
        self.answer({"choices": choices, "usage": {"completion_tokens": 1}})

    def log_message(self, *args):
        pass


urls = {}
for name, host in (("URL", "192.0.2.2"), ("LOOP", "127.0.0.1")):
    server = ThreadingHTTPServer((host, 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    urls[name] = "http://%s:%d" % (host, server.server_address[1])
env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
rows = []
for argv in json.loads(sys.argv[1]):
    seen.clear()
    done = subprocess.run([sys.executable, "-m", "arealcli.main", *[urls.get(a, a) for a in argv]],
                          input="hi\n", capture_output=True, text=True, env={**env, "AREAL_API_KEY": "k-123"})
    rows.append({"rc": done.returncode, "out": done.stdout + done.stderr, "err": done.stderr, "seen": list(seen)})
print(json.dumps(rows))
"""


def in_private_network(*commands: list[str]) -> list[dict]:
    """Run `areal COMMAND...` against a recording server at a non-loopback address, in a network
    namespace of this test's own (root only: creating one needs CAP_SYS_ADMIN)."""
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("a private network namespace needs root")
    done = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", NETNS_SCRIPT, json.dumps(list(commands))],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0 and not done.stdout.strip():
        if "unshare" in done.stderr and "Operation not permitted" in done.stderr:
            pytest.skip("network namespaces are not allowed here")
        raise AssertionError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_chat_sends_the_key_to_a_loopback_url_and_elsewhere_only_when_told():
    """`areal chat URL`: the key goes to a loopback URL; a URL of another machine gets none unless
    --send-key (one line on stderr says so)."""
    chat = ["chat", "URL", "--max-new-tokens", "4"]
    loop, plain, told = in_private_network(
        ["chat", "LOOP", "--max-new-tokens", "4"], chat, [*chat, "--send-key"]
    )
    assert loop["rc"] == 0 and "hello" in loop["out"], loop["out"][-2000:]
    assert loop["seen"] and set(loop["seen"]) == {"Bearer k-123"} and "was not sent" not in loop["err"]
    assert plain["rc"] == 0 and "hello" in plain["out"], plain["out"][-2000:]
    assert plain["seen"] and set(plain["seen"]) == {None}
    assert plain["err"].count("was not sent") == 1 and "--send-key" in plain["err"]
    assert told["rc"] == 0 and told["seen"] and set(told["seen"]) == {"Bearer k-123"}
    assert "was not sent" not in told["err"]


def test_eval_keeps_the_key_from_another_machine_unless_told(ws):
    """`areal eval URL`, the same rule (its requests are `areal chat`'s)."""
    args = ["eval", "URL", "--recipe", str(ws.recipe()), "--n", "0"]
    args += ["--data", str(ws.root / "test.jsonl"), "--limit", "2"]
    plain, told = in_private_network(args, [*args, "--send-key"])
    assert plain["rc"] == 0, plain["out"][-2000:]
    assert plain["seen"] and set(plain["seen"]) == {None} and plain["err"].count("was not sent") == 1
    assert told["rc"] == 0 and told["seen"] and set(told["seen"]) == {"Bearer k-123"}
