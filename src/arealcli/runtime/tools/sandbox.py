"""The `python` tool's sandbox: a model-written program runs in a subprocess that writes only a fresh
temporary folder, whether the trainer runs as root or as a user.

The child, between fork and exec (the Landlock ruleset and the seccomp filter are built by the parent):
- a new session, which it cannot leave (setsid/setpgid refused), so killing the group kills all it started;
- its own network and IPC namespaces (no network, no System V IPC or message queues shared with anyone),
  in a new user namespace when not root; the `nobody` user when started as root;
- rlimits on CPU time, address space, processes, open files and file size; no core dumps;
- Landlock: reads and runs only the system's folders (/usr, /etc, /lib*, /bin, /sbin, /proc, /sys), its
  Python installation and a few devices (/dev/null, zero, full, random, urandom); creates, writes,
  renames, removes and truncates only beneath its temporary folder (and writes /dev/null); no TCP; cannot
  ptrace (so cannot read the environment or memory of) processes outside the sandbox, nor (Linux >= 6.12)
  signal them or reach their abstract UNIX sockets;
- seccomp: no UNIX-domain sockets (a user's systemd, D-Bus, Docker or X11 socket would run code outside),
  no io_uring, no changes to any file's metadata (mode, owner, times, extended attributes, flags), no
  truncating by path, no kill(2) of -1 (every process it may signal) or of a process group (a negative
  pid, its own too). Before Linux 6.12 (no Landlock signal scope) it can still signal a single process
  by its pid: the trainer's, and others of the same user (of `nobody` when the trainer runs as root).
Its output is read as it comes (`_collect`): one that prints past its limit is stopped, never buffered.
A kernel without Landlock (before 5.13, or not in its `lsm=` list) or a machine other than x86_64 or
aarch64 gets a refusal, never an unconfined run. Standard library only: tests run it as another user.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

NOBODY = 65534
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWNET = 0x08000000, 0x10000000, 0x40000000
PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, SECCOMP_MODE_FILTER = 22, 38, 2
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long


def _syscall(nr: int, *args: object) -> int:
    """syscall(2), integers passed as C longs (a variadic call would pass them as ints)."""
    return _LIBC.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))


class SandboxError(Exception):
    """The program did not run or did not finish well; the message says why (the model reads it)."""


# ------------------------------------------------------------------ Landlock

SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR, FS_TRUNCATE = 1, 2, 4, 8, 1 << 14
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
SYSTEM_FOLDERS = ("/usr", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/proc", "/sys")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when it has none (too old, or not enabled)."""
    return max(_syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION), 0)


def _fs_rights(abi: int) -> int:
    """Every filesystem right this ABI knows (v2 adds REFER, v3 TRUNCATE, v5 IOCTL_DEV)."""
    return (1 << (13 if abi == 1 else 14 if abi == 2 else 15 if abi < 5 else 16)) - 1


def _oserror(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def _landlock_ruleset(workdir: str, readable: list[str]) -> int:
    """A ruleset fd: read and run `readable`, read/write the devices, everything beneath `workdir`."""
    abi = landlock_abi()
    if abi < 1:
        raise SandboxError(
            "this kernel has no Landlock (Linux 5.13 or later with landlock in its lsm= list), so "
            "the program's writes could not be confined and it is not run"
        )
    every = _fs_rights(abi)
    attr = _RulesetAttr(
        every,
        NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0,
    )
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    fd = _syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if fd < 0:
        raise SandboxError(f"Landlock refused a ruleset ({_oserror('create').strerror})")
    read_file = FS_READ_FILE | FS_EXECUTE
    rules = [(p, read_file | FS_READ_DIR if os.path.isdir(p) else read_file) for p in readable]
    rules += [(d, FS_READ_FILE) for d in DEVICES]
    rules += [("/dev/null", FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0)), (workdir, every)]
    try:
        for path, rights in rules:
            _add_rule(fd, path, rights)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _add_rule(ruleset: int, path: str, rights: int) -> None:
    try:
        target = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # a folder this system lacks (/lib32, /sys in a container, ...)
    try:
        rule = _PathBeneath(rights, target)
        rc = _syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
        if rc != 0:
            raise SandboxError(f"Landlock refused a rule for {path} ({_oserror('add rule').strerror})")
    finally:
        os.close(target)


def _readable(interpreter: str) -> list[str]:
    """What the program may read and run: the system's folders and the interpreter's installation."""
    prefixes = {os.path.dirname(os.path.dirname(os.path.realpath(interpreter)))}
    if interpreter == sys.executable:
        prefixes |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return list(SYSTEM_FOLDERS) + sorted(p for p in prefixes if p not in ("", os.sep))


# ------------------------------------------------------------------ seccomp

SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ALLOW, SECCOMP_RET_EPERM = 0x80000000, 0x7FFF0000, 0x00050000 | 1
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
AF_UNIX, X32_SYSCALL_BIT = 1, 0x40000000
_SHARED = {
    "io_uring_setup": 425,
    "fchmodat2": 452,
    "setxattrat": 463,
    "removexattrat": 466,
    "file_setattr": 469,
}
ARCHES = {  # audit arch, socket(2), kill(2), refused syscalls
    "x86_64": (0xC000003E, 41, 62, _SHARED | {
        "chmod": 90, "fchmod": 91, "chown": 92, "fchown": 93, "lchown": 94, "truncate": 76, "utime": 132,
        "utimes": 235, "fchownat": 260, "futimesat": 261, "fchmodat": 268, "utimensat": 280,
        "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198,
        "fremovexattr": 199, "setsid": 112, "setpgid": 109,
    }),
    "aarch64": (0xC00000B7, 198, 129, _SHARED | {
        "fchmod": 52, "fchmodat": 53, "fchownat": 54, "fchown": 55, "truncate": 45, "utimensat": 88,
        "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15,
        "fremovexattr": 16, "setsid": 157, "setpgid": 154,
    }),
}  # fmt: skip


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


Instruction = tuple[int, int | str, int | str, int]  # (code, jump if true, if false, k); str: a label


def _assemble(lines: list[Instruction | str]) -> list[tuple[int, int, int, int]]:
    """BPF instructions with their jumps to labels (the strings in `lines`) made relative."""
    labels: dict[str, int] = {}
    code: list[Instruction] = []
    for line in lines:
        if isinstance(line, str):
            labels[line] = len(code)
        else:
            code.append(line)

    def offset(jump: int | str, pc: int) -> int:
        return labels[jump] - pc - 1 if isinstance(jump, str) else jump

    return [(op, offset(jt, pc), offset(jf, pc), k) for pc, (op, jt, jf, k) in enumerate(code)]


def seccomp_filter(machine: str | None = None) -> _SockFprog:
    """A BPF program: other ABIs killed; the refused syscalls, socket(AF_UNIX, ...) and kill(2) with a
    negative pid (-1: every process the program may signal; -PGID: a process group) get EPERM."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise SandboxError(f"the sandbox knows x86_64 and aarch64 system calls, not {machine}'s; not run")
    arch, socket_nr, kill_nr, refused = ARCHES[machine]
    lines: list[Instruction | str] = [
        (BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (BPF_JEQ_K, 1, 0, arch),
        (BPF_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),
        (BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (BPF_JGE_K, "deny", 0, X32_SYSCALL_BIT),
        (BPF_JEQ_K, "socket", 0, socket_nr),
        (BPF_JEQ_K, "kill", 0, kill_nr),
        *[(BPF_JEQ_K, "deny", 0, nr) for nr in sorted(refused.values())],
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        "socket",
        (BPF_LD_W_ABS, 0, 0, 16),  # the low word of seccomp_data.args[0]: socket's domain
        (BPF_JEQ_K, "deny", 0, AF_UNIX),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        "kill",
        (BPF_LD_W_ABS, 0, 0, 16),  # the low word of args[0]: kill's pid (a 32-bit pid_t)
        (BPF_JGE_K, "deny", 0, 1 << 31),  # negative
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        "deny",
        (BPF_RET_K, 0, 0, SECCOMP_RET_EPERM),
    ]
    code = _assemble(lines)
    program = (_SockFilter * len(code))(*(_SockFilter(c, jt, jf, k) for c, jt, jf, k in code))
    fprog = _SockFprog(len(code), ctypes.cast(program, ctypes.POINTER(_SockFilter)))
    fprog.program = program  # kept alive with it
    return fprog


# ------------------------------------------------------------------ the child


@dataclass
class _Plan:
    """What the child applies between fork and exec; prepared by the parent."""

    memory_bytes: int
    cpu_s: int
    ruleset_fd: int
    seccomp: _SockFprog
    report_fd: int = -1  # the child writes the step that failed here (closed at exec)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise _oserror(what)


def _confine(plan: _Plan) -> None:  # runs in the child, before exec
    step = "a new session"
    try:
        os.setsid()
        step = "network isolation"
        root = os.geteuid() == 0
        _check(_LIBC.unshare(CLONE_NEWNET | CLONE_NEWIPC | (0 if root else CLONE_NEWUSER)), "unshare")
        step = "limits"
        limits = {
            resource.RLIMIT_AS: plan.memory_bytes,
            resource.RLIMIT_CPU: plan.cpu_s,
            resource.RLIMIT_NPROC: 32,
            resource.RLIMIT_NOFILE: 64,
            resource.RLIMIT_FSIZE: 1 << 20,
            resource.RLIMIT_CORE: 0,
        }
        for kind, value in limits.items():
            resource.setrlimit(kind, (value, value))
        if root:  # process limits bind an unprivileged user only
            step = "dropping root"
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        step = "Landlock"
        _check(_LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        _check(_syscall(SYS_LANDLOCK_RESTRICT_SELF, plan.ruleset_fd, 0), "restrict_self")
        step = "seccomp"
        _check(_LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(plan.seccomp), 0, 0), "seccomp")
    except BaseException:
        os.write(plan.report_fd, step.encode())
        raise


# ------------------------------------------------------------------ the parent


def _world_runnable(path: str) -> bool:
    """Can an unprivileged user run `path` (every folder on the way searchable, the file executable)?"""
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    folders = [os.sep.join(parts[:i]) or os.sep for i in range(1, len(parts))]
    return all(os.stat(f).st_mode & 0o001 for f in folders) and bool(os.stat(real).st_mode & 0o001)


def interpreter() -> str:
    """This Python, or (started as root, which the sandbox leaves) one the `nobody` user can run."""
    if os.geteuid() != 0:
        return sys.executable
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _world_runnable(candidate):
            return candidate
    raise SandboxError("no Python interpreter an unprivileged user can run (the sandbox drops root)")


def run_confined(
    code: str, timeout_s: float = 5.0, memory_mb: int = 256, max_output_chars: int = 2000
) -> str:
    """Run `code` with `python -I` in the sandbox, in a fresh temporary folder removed afterwards; its
    stdout, or a SandboxError with the last line of its error."""
    python = interpreter()
    seccomp = seccomp_filter()
    workdir = tempfile.mkdtemp(prefix="areal-python-")
    try:
        if os.geteuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)
        ruleset = _landlock_ruleset(workdir, _readable(python))
        try:
            plan = _Plan(memory_mb << 20, max(1, math.ceil(timeout_s)), ruleset, seccomp)
            proc = _start([python, "-I", "-c", code], workdir, plan)
        finally:
            os.close(ruleset)
        return _collect(proc, timeout_s, max_output_chars)
    finally:
        remove_tree(workdir)


def _start(argv: list[str], workdir: str, plan: _Plan) -> subprocess.Popen:
    """Start the confined child; a failure to set the sandbox up is a SandboxError naming the step."""
    report_r, plan.report_fd = os.pipe2(os.O_CLOEXEC)
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1"},
            preexec_fn=lambda: _confine(plan),
        )
    except subprocess.SubprocessError:
        os.close(plan.report_fd)
        plan.report_fd = -1
        step = os.read(report_r, 200).decode(errors="replace") or "the sandbox"
        raise SandboxError(f"{step} could not be set up on this machine, so the program is not run") from None
    except OSError as e:
        raise SandboxError(f"cannot start ({e.strerror})") from None
    finally:
        if plan.report_fd >= 0:
            os.close(plan.report_fd)
        os.close(report_r)


ERROR_TAIL = 8192  # bytes of the program's stderr kept (its last line is the error shown)
ERROR_BUDGET = 1 << 20  # stderr bytes read before the program is stopped


@dataclass
class _Output:
    """What the program printed, read as it comes: stdout up to `budget` bytes, the tail of stderr."""

    budget: int
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    err_total: int = 0
    flooded: str = ""  # "stdout" or "stderr": it printed past its budget and was stopped

    def add(self, stream: str, chunk: bytes) -> None:
        if stream == "stdout":
            self.out += chunk
            if len(self.out) > self.budget:
                del self.out[self.budget :]
                self.flooded = "stdout"
            return
        self.err += chunk
        self.err_total += len(chunk)
        del self.err[:-ERROR_TAIL]
        if self.err_total > ERROR_BUDGET:
            self.flooded = "stderr"


def _read(proc: subprocess.Popen, timeout_s: float, output: _Output) -> None:
    """Read the program's stdout and stderr as they come until both close and it exits, or it floods
    (`output.flooded`); never more than the budgets in memory. subprocess.TimeoutExpired at the end of
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None and proc.stderr is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, "stdout")
        selector.register(proc.stderr, selectors.EVENT_READ, "stderr")
        while selector.get_map() and not output.flooded:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout_s)
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    output.add(key.data, chunk)
                else:
                    selector.unregister(key.fileobj)
    if not output.flooded:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.01))


def _collect(proc: subprocess.Popen, timeout_s: float, max_output_chars: int) -> str:
    """Wait for the program (killing its whole process group at the end); its stdout, or why it failed.
    Its output is read as it comes: one that prints more than `max_output_chars` (4 bytes a character)
    is stopped there, so an endless print never fills the trainer's memory."""
    output = _Output(budget=max(max_output_chars, 1) * 4)
    try:
        _read(proc, timeout_s, output)
    except subprocess.TimeoutExpired:
        raise SandboxError(f"no result within {timeout_s:g} s") from None
    finally:
        _kill_group(proc)  # whatever it started dies with it (it cannot leave the group)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    text = output.out.decode(errors="replace")[:max_output_chars].rstrip()
    if output.flooded == "stdout":
        return f"{text}\n[stopped: it printed more than {max_output_chars} characters]"
    if output.flooded == "stderr":
        raise SandboxError(f"stopped: it wrote more than {ERROR_BUDGET >> 20} MiB of errors")
    if proc.returncode != 0:
        err = output.err.decode(errors="replace")
        last = err.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # the CPU-time limit (soft, then hard)
            last = [f"no result within {timeout_s:g} s (its CPU time limit)"]
        elif proc.returncode < 0:
            last = [f"killed by {signal.Signals(-proc.returncode).name}"]
        raise SandboxError(last[0][:300])
    return text


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def remove_tree(path: str) -> None:
    """Remove the temporary folder, also folders the program made unreadable (mkdir with mode 0)."""

    def unlock(func, failed: str, *_: object) -> None:
        if func in (os.open, os.scandir) and os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, 0o700)
            shutil.rmtree(failed, **handler)

    handler: dict[str, Any] = {"onexc" if sys.version_info >= (3, 12) else "onerror": unlock}
    for _ in range(3):  # a process of the group being killed may still add a file
        shutil.rmtree(path, **handler)
        if not os.path.lexists(path):
            return
