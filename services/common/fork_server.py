"""A fork server for a service's processes: one interpreter imports the service once, then forks
each new process of it from itself.

Starting ``shardline serve worker`` costs about 3 s of CPU before the worker does anything of
its own (2 s of it importing torch, on a 2-core AMD EPYC); a worker forked from a server that has
imported it already starts at once. The fleet's local provisioner starts its replica groups here:
the first group, a heal's replacement, a rollout's candidate, an autoscaled group.

The server is a fresh interpreter, never a fork of the launcher (whose gRPC threads must not be
forked); it starts no thread and runs no tensor op. Each request forks it, and the child becomes
what ``Popen([python, "-m", module, *args])`` would have started: its own session, stdin from
/dev/null, stdout and stderr to its log file, the requested environment and working directory,
``sys.argv``, and its command line (``/proc/PID/cmdline``, what ``ps`` shows: the server's own
command line is started long enough to hold it); then it runs the module as ``python -m`` does,
and exits as an interpreter does (exceptions, ``SystemExit``, atexit, non-daemon threads).

Modules imported under one environment behave as that environment says (OpenMP's thread count,
torch's CPU capability), so a request whose environment differs from the server's in anything
is not for the server (:meth:`ForkServer.fits`): the launcher starts it as a fresh interpreter.

The server reports each child's pid and, when it exits, its exit code (negative: the signal that
killed it, as ``subprocess`` says). It exits when its launcher is gone (its stdin closes, however
the launcher died); a child asked to die with its parent gets SIGTERM then (PR_SET_PDEATHSIG), as
it would from a launcher that started it directly, and a kept child goes on serving. A request the
launcher queued before it died (while the server still imported) is dropped, not forked: no one
is left to learn the child's pid, and a kept child would serve on with no one to stop it.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from services.common import heap

PR_SET_PDEATHSIG = 1
TITLE_ROOM = 4096  # bytes of command line the server starts with, for its children's
UNKNOWN_EXIT = -1  # a child that exited after its server was killed: nobody saw its code
REPLY_TIMEOUT_S = 120.0  # the first request waits for the server's imports


# ---- in the server ------------------------------------------------------------------------------

def _write(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _reap(out: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _write(out, {"pid": pid, "exit": os.waitstatus_to_exitcode(status)})


def serve_forks(modules: list[str], launcher: int) -> dict[str, Any] | None:
    """Import ``modules``, then fork one child per request line on stdin. Returns None in the
    server when its launcher (pid ``launcher``, the server's parent while it lives) is gone, and
    the request in each child."""
    heap.starting()
    for name in modules:  # by name: the launcher's modules (common imports nothing above it)
        importlib.import_module(name)
    heap.started()  # what the imports made stays in pages the children share, untouched by their collections
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # it goes when its launcher goes, not on a terminal's signal
    pending = b""
    while True:
        ready, _, _ = select.select([0, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(1)
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            return None
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if os.getppid() != launcher:
                # the launcher went while this server imported: a request it queued is no one's now,
                # and a child meant to outlive it would be a process no one knows of
                return None
            try:
                pid = os.fork()
            except OSError as exc:
                _write(1, {"id": request["id"], "error": str(exc)})
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                os.close(wake_r)
                os.close(wake_w)
                request["server_pid"] = os.getppid()
                return request
            _write(1, {"id": request["id"], "pid": pid})


def set_command_line(argv: list[str]) -> None:
    """Rewrite what ``/proc/self/cmdline`` says (within the room the process started with)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49
        data = "\0".join(argv).encode()[:end - start - 1]
        data += b"\0" * (end - start - len(data))  # ends in NUL: the kernel reads the whole area
        ctypes.memmove(start, data, len(data))
    except (OSError, IndexError, ValueError):
        pass  # cosmetic where /proc is missing


def die_with_parent() -> None:
    """Get SIGTERM when the parent process exits (Linux; nothing elsewhere). Also a ``preexec_fn``,
    between fork and exec in a threaded parent: anything it raises would fail the start."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def become(request: dict[str, Any]) -> str:
    """In a child: take the process state the request asks for; returns the module to run."""
    if request["new_session"]:
        os.setsid()
    if request["die_with_parent"]:
        die_with_parent()
        if os.getppid() != request["server_pid"]:
            os._exit(1)  # the server (and so the launcher) went before the signal was set
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC),
                  0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    set_command_line(argv)
    sys.argv = [argv[0], *argv[3:]]  # run_module puts the module's path first, as `python -m` does
    return argv[2]


# ---- in the launcher ----------------------------------------------------------------------------

class ForkedProcess:
    """A child of the fork server, with the part of ``subprocess.Popen`` a supervisor uses."""

    def __init__(self, server: ForkServer, argv: list[str], pid: int) -> None:
        self.server = server
        self.args = argv
        self.pid = pid
        self.returncode: int | None = None
        self.exited = threading.Event()

    def _exit(self, code: int) -> None:
        self.returncode = code
        self.exited.set()

    def poll(self) -> int | None:
        if not self.exited.is_set() and not self.server.alive and not live_process(self.pid):
            self._exit(UNKNOWN_EXIT)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not after: the pid may name another process by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.exited.wait(0.1 if left is None else min(0.1, left))
        return self.returncode  # type: ignore[return-value]


def kill_group(pgid: int, *, leader_alive: bool) -> None:
    """SIGKILL process group ``pgid`` (a driver's ranks outlive a SIGKILLed driver). While its
    leader lives (or is not yet reaped) the pid is still the leader's. Once the leader is reaped
    the pid is free, and pids wrap (a full test run goes through 32768 of them in about ten
    minutes): a live process that now has that pid and leads a group of its own is someone else's,
    and its group is left alone."""
    if not leader_alive:
        try:
            fields = Path(f"/proc/{pgid}/stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                return
        except (OSError, IndexError, ValueError):
            pass  # no process has the pid: the group, if it is left, is the old leader's
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def live_process(pid: int) -> bool:
    """A live process (a zombie, exited but not reaped by its parent, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class ForkServer:
    """The launcher's side: starts the server on first use, forks children from it."""

    def __init__(self, modules: list[str], *, environ: dict[str, str] | None = None) -> None:
        """``environ``: the server's environment (this process's when it starts, by default);
        only a request with exactly this environment fits."""
        self.modules = list(modules)
        self._fixed_environ = environ
        self.environ = dict(os.environ if environ is None else environ)  # the server's, from its start
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._replies: dict[int, dict[str, Any]] = {}
        self._replied = threading.Condition(self._lock)
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._next_id = 0

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def fits(self, argv: list[str], env: dict[str, str], log_path: Path | None) -> bool:
        """A ``python -m`` command, with a log file, whose environment is the server's."""
        return (len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and log_path is not None
                and env == (self.environ if self._proc is not None or self._fixed_environ is not None
                            else dict(os.environ)))

    def _start(self) -> None:
        self.environ = dict(os.environ if self._fixed_environ is None else self._fixed_environ)
        room = "." * TITLE_ROOM
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, room, str(os.getpid()), *self.modules],
                                      env=self.environ,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        threading.Thread(target=self._read, args=(self._proc,), name="fork-server", daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            message = json.loads(line)
            with self._lock:
                if "id" in message:
                    self._replies[message["id"]] = message
                    self._replied.notify_all()
                elif message["pid"] in self._children:
                    self._children.pop(message["pid"])._exit(message["exit"])
                else:  # exited before spawn() recorded it
                    self._early_exits[message["pid"]] = message["exit"]
        with self._lock:
            self._replied.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path, *, append: bool = False,
              cwd: Path | None = None, new_session: bool = True, die_with_parent: bool = True) -> ForkedProcess:
        """Fork ``argv`` (``[python, -m, module, *args]``) with its output to ``log_path``
        (appended to, or the file truncated first), in ``cwd`` (this process's by default);
        OSError when the server cannot."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            proc = self._proc
            assert proc is not None and proc.stdin is not None
            self._next_id += 1
            request_id = self._next_id
            request = {"id": request_id, "argv": argv, "env": env, "log": str(log_path), "append": append,
                       "cwd": str(cwd or os.getcwd()), "new_session": new_session, "die_with_parent": die_with_parent}
            try:
                proc.stdin.write((json.dumps(request) + "\n").encode())
                proc.stdin.flush()
            except OSError as exc:
                raise OSError(f"the fork server is gone: {exc}") from exc
            deadline = time.monotonic() + REPLY_TIMEOUT_S
            while request_id not in self._replies:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise OSError("the fork server did not fork" + (
                        f" (it exited with code {proc.returncode})" if proc.returncode is not None else ""))
                self._replied.wait(0.5)
            reply = self._replies.pop(request_id)
            if "error" in reply:
                raise OSError(f"the fork server could not fork: {reply['error']}")
            child = ForkedProcess(self, argv, reply["pid"])
            if reply["pid"] in self._early_exits:
                child._exit(self._early_exits.pop(reply["pid"]))
            else:
                self._children[reply["pid"]] = child
            return child

    def close(self) -> None:
        """Stop the server (its children go on: those meant to die with it get SIGTERM)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def main(argv: list[str]) -> None:
    """``argv``: the room for the children's command lines, the launcher's pid, the modules."""
    set_command_line([sys.executable, "-m", __spec__.name if __spec__ else "fork_server", *argv[1:]])
    request = serve_forks(argv[2:], launcher=int(argv[1]))
    if request is None:
        return
    module = become(request)
    del request
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
