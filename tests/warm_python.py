"""The suite's warm Python: training processes forked from a server that has imported torch and DeepSpeed already.

A training process on a 2-core CPU spends ~7 s importing torch, torch._dynamo (torch.optim's first optimizer imports
it), DeepSpeed and the inductor (DeepSpeed 0.19's ZeRO-1/2 gradient reduction imports its Muon optimizer, and that
the inductor) before its first step: three quarters of a test run's time. The suite starts its training processes
through this file instead of `python`:

    python tests/warm_python.py [-u] (SCRIPT | -m MODULE | -c CODE) [ARGS...]

That client connects to the server named by FASTMAE_WARM_PYTHON (a Unix socket that tests/conftest.py starts once
per pytest worker), hands it its standard streams, command line, working directory and environment, and the server
forks a process that runs the command as `python` would, with those. The client stands in for that process: its
command line is the command's (psutil's searches by run directory or `--local_rank=N` find it), a SIGTERM, SIGINT or
SIGHUP to it reaches the process, the process's exit code or signal is its own, when the client dies (SIGKILL to it
or to its process group) the server kills the process at once, and when the server dies its processes die too.

What stays cold (the client runs `python` itself, exec'd in its place): no server, a server that cannot be reached,
a command line of another form, a client handed file descriptors besides its standard streams, and an environment
that differs from the server's in any variable a preloaded module reads at import (TORCH*, TRITON*, OMP_*, DS_*,
PYTHON* ...: see `_IMPORT_TIME`). What differs from a cold process: its parent is the server (a rank's launcher is
its client's parent; fastmae finds DeepSpeed's launcher by its parents, so tests of that launcher start cold), and
the few milliseconds between the client's death and the process's. With FASTMAE_WARM_PYTHON_EXECUTABLE set, the
`python` a forked process starts through sys.executable (a study's training runs) is forked too.
"""

from __future__ import annotations

import json
import os
import selectors
import shlex
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback

SOCKET_VARIABLE = "FASTMAE_WARM_PYTHON"
EXECUTABLE_VARIABLE = "FASTMAE_WARM_PYTHON_EXECUTABLE"
"""Where set (to an executable that runs this client), a forked process's sys.executable: the `python` processes it
starts itself (a study's training runs) start warm too."""
_HEADER = struct.Struct("!Q")
# variables whose value a preloaded module may have read while it was imported: a request must agree with the server
# (and glibc's, which it reads as a process starts: fastmae's entry points restart with GLIBC_TUNABLES set)
_IMPORT_TIME = ("TORCH", "PYTORCH", "TRITON", "OMP_", "MKL", "KMP_", "GOMP", "CUDA", "NCCL", "DS_", "DEEPSPEED",
                "PYTHON", "LD_", "GLIBC_", "MALLOC_", "HF_", "TRANSFORMERS", "XDG_CACHE", "HOME")
# set in the forked process from its own environment; CUDA_VISIBLE_DEVICES (which launchers set) is read when CUDA
# initializes, and the server serves only where no CUDA device is (tests/conftest.py)
_PER_PROCESS = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "CUDA_VISIBLE_DEVICES")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _parse(args: list[str]) -> tuple[bool, str, str, list[str]] | None:
    """(unbuffered, kind, target, argv) of a `python` command line of the forms this file takes; None otherwise."""
    unbuffered = False
    while args and args[0] == "-u":
        unbuffered, args = True, args[1:]
    if len(args) >= 2 and args[0] in ("-m", "-c"):
        kind, target = args[0], args[1]
        return unbuffered, kind, target, ["-m" if kind == "-m" else "-c", *args[2:]]
    if args and not args[0].startswith("-"):
        return unbuffered, "script", args[0], args
    return None


COMMAND = (sys.executable, os.path.abspath(__file__))
"""What the suite starts a training process with in place of `python` (`[*COMMAND, "-m", "fastmae.train", ...]`)."""
COLD_VARIABLES = ("TRITON_INTERPRET", "RANK", "WORLD_SIZE")
"""Variables of the suite's own process that its training processes run without (benchmarks/chaos.py drops them)."""


def environment(**extra: str) -> dict[str, str]:
    """The suite's environment less COLD_VARIABLES, with `extra`: what a training process the suite starts gets."""
    return {**{k: v for k, v in os.environ.items() if k not in COLD_VARIABLES}, **extra}


def warm(command: list[str]) -> list[str]:
    """`command` through the warm Python where it starts `python` (sys.executable); as it is otherwise."""
    return [*COMMAND, *command[1:]] if command[:1] == [sys.executable] else command


def forked_processes() -> list:
    """The processes that the server this process started forked and that still run (psutil.Process each)."""
    import psutil

    def running(process):
        try:
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [p for p in psutil.Process(started_server.pid).children() if running(p)] if started_server else []


def start_server(path: str, log) -> subprocess.Popen:
    """The server on the Unix socket `path`, its output to `log`, with the suite's environment less COLD_VARIABLES:
    the environment of the processes the suite starts. It imports for ~7 s; requests meanwhile wait."""
    global started_server, started_executable
    executable = f"{path}.python"
    with open(executable, "w") as shim:
        shim.write(f'#!/bin/sh\nexec {shlex.quote(COMMAND[0])} {shlex.quote(COMMAND[1])} "$@"\n')
    os.chmod(executable, 0o755)
    server = subprocess.Popen([*COMMAND[:1], "-u", COMMAND[1], "--serve", path], env=environment(), stdout=log,
                              stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):  # bound (its imports follow): a client from now on waits for it, not runs cold
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"warm_python: the server did not start (exit {server.poll()})")
        time.sleep(0.01)
    started_server, started_executable = server, executable
    return server


started_server: subprocess.Popen | None = None
"""The server this process started (start_server)."""
started_executable: str | None = None
"""An executable that runs this client, beside that server's socket: EXECUTABLE_VARIABLE's value."""
start_failure: str | None = None
"""Why the server this process tried to start did not (tests/conftest.py)."""


# ---------------------------------------------------------------------------------------------------------- client


def _cold(args: list[str]) -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)  # a signal held meanwhile acts now, as on `python`
    os.execv(sys.executable, [sys.executable, *args])


def _read_line(connection: socket.socket, received: bytearray, wake: socket.socket | None = None,
               pid: int = 0) -> dict | None:
    """The server's next line (JSON), None once the server is gone; `received` keeps what came after that line.
    With `wake` (the signal wakeup socket), each signal this process gets meanwhile is sent on to `pid`: the wakeup
    socket wakes the wait even where a signal lands just before it blocks (a handler alone would run only after)."""
    with selectors.DefaultSelector() as selector:
        selector.register(connection, selectors.EVENT_READ)
        if wake is not None:
            selector.register(wake, selectors.EVENT_READ)
        while b"\n" not in received:
            for key, _ in selector.select():
                if key.fileobj is wake:
                    for signum in wake.recv(4096):
                        try:
                            os.kill(pid, signum)
                        except ProcessLookupError:
                            pass
                    continue
                chunk = connection.recv(4096)
                if not chunk:
                    return None
                received += chunk
    line, _, rest = bytes(received).partition(b"\n")
    received[:] = rest
    return json.loads(line)


def _inherited_descriptors() -> list[int]:
    """File descriptors beyond the standard streams that this process was started with (Popen's pass_fds:
    multiprocessing's and the inductor's workers get their pipes so): the server forks with the three alone. (The
    descriptor that lists /proc/self/fd is closed by the time each is checked.)"""
    listed = [int(name) for name in os.listdir("/proc/self/fd")]
    inherited = []
    for fd in listed:
        try:
            os.fstat(fd)
        except OSError:
            continue
        inherited.append(fd)
    return [fd for fd in inherited if fd > 2]


def client(args: list[str]) -> None:
    """Run `python ARGS` in a process forked by the server; exit as it exits. Falls back to exec'ing `python`."""
    path = os.environ.get(SOCKET_VARIABLE)
    if not path or _parse(args) is None or _inherited_descriptors():
        _cold(args)
    # held from here until they can be sent on: a signal before the process's pid is known neither kills this
    # client (leaving the process to the server) nor is lost
    signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    received = bytearray()
    try:
        connection.connect(path)
        request = json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        socket.send_fds(connection, [_HEADER.pack(len(request))], [0, 1, 2])
        connection.sendall(request)
        reply = _read_line(connection, received)
    except OSError:
        reply = None
    if reply is None or "pid" not in reply:
        connection.close()
        _cold(args)
    wake, wake_write = socket.socketpair()
    wake.setblocking(False)
    wake_write.setblocking(False)
    signal.set_wakeup_fd(wake_write.fileno())
    for signum in _FORWARDED:
        signal.signal(signum, lambda signum, frame: None)  # not to die of it: the wakeup socket carries it on
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
    ended = _read_line(connection, received, wake, reply["pid"])
    if ended is None:  # the server is gone: its processes with it
        sys.exit(1)
    if "signal" in ended:
        if ended["signal"] in _FORWARDED:  # caught here: die of it as the process did
            signal.signal(ended["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), ended["signal"])
    sys.exit(ended["exit"])


# ---------------------------------------------------------------------------------------------------------- server


def _preload() -> None:
    """Import what every training process imports."""
    import deepspeed  # noqa: F401
    import numpy  # noqa: F401
    import torch._dynamo  # noqa: F401
    try:  # DeepSpeed 0.19's ZeRO-1/2 imports it (and the inductor) in its gradient reduction
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:
        pass


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(connection, _HEADER.size, 3)
    try:
        size, = _HEADER.unpack(header)
        data = b""
        while len(data) < size:
            chunk = connection.recv(size - len(data))
            if not chunk:
                raise ConnectionError("the client left before its request ended")
            data += chunk
        return json.loads(data), fds
    except BaseException:
        for fd in fds:  # the client's streams, held here no longer
            os.close(fd)
        raise


def _why_cold(request: dict, before: dict[str, str], imported: dict[str, str], threads: int) -> str:
    """Why a request must run cold, empty when it may be forked. `before`: the server's environment before its
    imports; `imported`: what they set in it (a request may carry either value: the same imports in a cold process
    leave it as `imported` says)."""
    if _parse(request["args"]) is None:
        return "a command line of another form"
    if threads != 1:
        return f"{threads} threads in the server"
    env = request["env"]
    differing = sorted(k for k in {*before, *env} if k.startswith(_IMPORT_TIME) and k not in _PER_PROCESS
                       and env.get(k) not in (before.get(k), imported.get(k, before.get(k))))
    return f"import-time variables differ: {', '.join(differing)}" if differing else ""


def _send(connection: socket.socket, message: dict) -> None:
    try:
        connection.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the client is gone


def serve(path: str) -> dict:
    """Accept requests until SIGTERM; returns (in a forked process only) the request it is to run."""
    import threading

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    before = dict(os.environ)
    _preload()
    # what the imports set (DeepSpeed sets TORCHINDUCTOR_CACHE_DIR, torch PYTORCH_NVML_BASED_CUDA_CHECK): a forked
    # process's environment has it as a cold process's would
    imported = {k: v for k, v in os.environ.items() if before.get(k) != v}
    if threading.active_count() != 1:  # a fork would lose the other threads: every request stays cold
        print(f"warm_python: {threading.active_count()} threads after the imports; serving cold", file=sys.stderr)
    wake_read, wake_write = socket.socketpair()
    wake_read.setblocking(False)
    wake_write.setblocking(False)
    signal.set_wakeup_fd(wake_write.fileno())
    stopping = []
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "listener")
    selector.register(wake_read, selectors.EVENT_READ, "wake")
    children: dict[int, socket.socket] = {}  # pid -> its client's connection
    server_pid = os.getpid()
    while not stopping:
        for key, _ in selector.select():
            try:
                if key.data == "wake":
                    try:
                        wake_read.recv(4096)
                    except BlockingIOError:
                        pass
                    _reap(children, selector)
                elif key.data == "listener":
                    connection, _ = listener.accept()
                    try:
                        request, fds = _receive(connection)
                    except (OSError, ValueError, struct.error):  # a client gone before its request ended
                        connection.close()
                        continue
                    cold = _why_cold(request, before, imported, threading.active_count())
                    if cold:
                        print(f"warm_python: cold: {shlex.join(request['args'])[:300]}: {cold}", flush=True)
                        for fd in fds:
                            os.close(fd)
                        _send(connection, {"cold": cold})
                        connection.close()
                        continue
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        _die_with(server_pid)
                        signal.set_wakeup_fd(-1)
                        for signum in (signal.SIGCHLD, signal.SIGTERM):
                            signal.signal(signum, signal.SIG_DFL)
                        for sock in (listener, wake_read, wake_write, connection, *children.values()):
                            sock.close()
                        selector.close()
                        for target, fd in enumerate(fds):
                            os.dup2(fd, target)
                            os.close(fd)
                        request["env"].update(imported)
                        return request
                    for fd in fds:
                        os.close(fd)
                    children[pid] = connection
                    selector.register(connection, selectors.EVENT_READ, pid)
                    _send(connection, {"pid": pid})
                else:  # the client sent nothing more, so it is gone: its process goes too
                    pid = key.data
                    if children.get(pid) is not key.fileobj:  # reaped earlier in this batch, its client told already
                        continue
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
                    children.pop(pid, None)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            except Exception:  # one request or event gone wrong: logged, and the server goes on serving
                if os.getpid() != server_pid:
                    os._exit(1)
                traceback.print_exc()
        _reap(children, selector)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    sys.exit(0)


def _die_with(server_pid: int) -> None:
    """In a process the server forked: be killed when the server dies (Linux's parent-death signal), so that no
    process of a server gone holds its client's streams open."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != server_pid:  # the server died before the signal was asked for
        os._exit(1)


def _reap(children: dict[int, socket.socket], selector) -> None:
    """Tell each ended process's client how it ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is None:
            continue
        selector.unregister(connection)
        if os.WIFSIGNALED(status):
            _send(connection, {"signal": os.WTERMSIG(status)})
        else:
            _send(connection, {"exit": os.waitstatus_to_exitcode(status)})
        connection.close()


def run(request: dict) -> None:
    """Become the requested `python` command (in the forked process): its directory, environment, streams and
    command line, then run its script, module or code as `python` runs them."""
    import builtins
    import runpy
    import types

    unbuffered, kind, target, argv = _parse(request["args"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    sys.stdout.reconfigure(write_through=unbuffered, line_buffering=os.isatty(1))
    sys.stderr.reconfigure(write_through=unbuffered, line_buffering=True)
    import numpy
    import torch

    torch.seed()  # a fresh process's generators start from the OS's entropy
    numpy.random.seed()
    sys.argv = argv
    sys.executable = os.environ.get(EXECUTABLE_VARIABLE) or sys.executable
    sys.orig_argv = [sys.executable, *request["args"]]  # a process that re-executes itself runs the command
    main = types.ModuleType("__main__")  # a fresh __main__, as `python` makes (this file's module stays aside)
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    if kind == "-m":
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(target, alter_argv=True)  # what `python -m` calls
        return
    if kind == "script":
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        main.__file__ = target
        with open(target, "rb") as source:
            code = compile(source.read(), target, "exec")
    else:
        sys.path[0] = ""
        code = compile(target, "<string>", "exec")
    exec(code, main.__dict__)

if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        run(serve(sys.argv[2]))
    else:
        client(sys.argv[1:])
