"""The suite's warm Python (tests/warm_python.py) runs a command as `python` would: the same output, exit code,
arguments, directory and environment; a signal to its client reaches the process, a client killed takes the process
with it; and what it cannot run warm it runs cold."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import warm_python


@pytest.fixture(autouse=True)
def server(warm_server):
    if warm_python.start_failure:
        pytest.fail(f"the warm server did not start: {warm_python.start_failure}")
    if warm_server is None:
        pytest.skip("no warm server where a CUDA device is (tests/conftest.py)")

SHOW = """
import os, sys
print(sys.argv, os.getcwd(), sys.path[0], os.environ.get("ASKED"), "GLIBC_TUNABLES" in os.environ)
print("seed", sys.modules["torch"].initial_seed() if "torch" in sys.modules else None)  # warm: imported already
print("to stderr", file=sys.stderr)
print("parent", os.getppid(), flush=True)
sys.exit(int(sys.argv[1]))
"""


def run(command, env, tmp_path):
    """(exit code, stdout's lines, stderr) of `command`, the parent's PID and torch's seed it printed."""
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    *lines, seed, parent = done.stdout.splitlines()
    return (done.returncode, lines, done.stderr), int(parent.split()[1]), seed


def test_a_command_runs_forked_as_it_runs_cold(tmp_path):
    env = warm_python.environment(ASKED="yes")
    warm, warm_parent, warm_seed = run([*warm_python.COMMAND, "-c", SHOW, "3", "x"], env, tmp_path)
    cold, cold_parent, cold_seed = run([sys.executable, "-c", SHOW, "3", "x"], env, tmp_path)
    assert warm == cold and cold[0] == 3 and cold[2] == "to stderr\n"
    assert cold[1] == [f"['-c', '3', 'x'] {tmp_path}  yes True"]  # argv, directory, sys.path[0], environment
    assert warm_parent == warm_python.started_server.pid != cold_parent  # forked by the server
    script = tmp_path / "script.py"
    script.write_text(SHOW)
    warm, warm_parent, again_seed = run([*warm_python.COMMAND, "-u", str(script), "0"], env, tmp_path)
    assert warm == run([sys.executable, "-u", str(script), "0"], env, tmp_path)[0]
    assert warm_parent == warm_python.started_server.pid
    assert cold_seed == "seed None" and len({warm_seed, again_seed}) == 2  # torch seeded afresh, as a new process does
    # a variable a preloaded module reads as it is imported, set otherwise: cold (exec'd in the client's place)
    _, parent, _ = run([*warm_python.COMMAND, "-c", SHOW, "0"], {**env, "TORCH_SHOW_CPP_STACKTRACES": "1"}, tmp_path)
    assert parent == os.getpid()
    # handed a descriptor besides the standard streams (a worker's pipe): cold, so that it keeps the descriptor
    read, write = os.pipe()
    try:
        done = subprocess.run([*warm_python.COMMAND, "-c", f"import os; os.fstat({read}); print(os.getppid())"],
                              env=env, pass_fds=(read,), capture_output=True, text=True, timeout=120)
    finally:
        os.close(read), os.close(write)
    assert done.stdout == f"{os.getpid()}\n", done.stderr
    # with EXECUTABLE_VARIABLE, the python a forked process starts through sys.executable is forked too
    nested = ("import subprocess, sys; "
              "sys.exit(subprocess.run([sys.executable, '-c', 'import os; print(os.getppid())']).returncode)")
    done = subprocess.run([*warm_python.COMMAND, "-c", nested], capture_output=True, text=True, timeout=120,
                          env={**env, warm_python.EXECUTABLE_VARIABLE: warm_python.started_executable})
    assert done.stdout == f"{warm_python.started_server.pid}\n", done.stderr


WAIT = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (print("SIGTERM", flush=True), sys.exit(0)))
print("ready", flush=True)
time.sleep(60)
"""


def forked_by_the_server(client: subprocess.Popen) -> psutil.Process:
    assert client.stdout.readline() == "ready\n"
    forked = warm_python.forked_processes()
    assert len(forked) == 1, forked
    return forked[0]


def states(*processes) -> str:
    """What the processes of a warm command and its server were doing (a failure's message): each one's state,
    signals pending, blocked and caught, and the kernel function it waits in; then the server's log."""
    lines = []
    for name, pid in (*processes, ("server", warm_python.started_server.pid)):
        try:
            status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            wchan = Path(f"/proc/{pid}/wchan").read_text()
        except OSError as err:
            lines.append(f"{name} {pid}: {err}")
            continue
        lines.append(f"{name} {pid}: " + ", ".join(f"{key} {status[key]}" for key in
                                                   ("State", "Threads", "SigPnd", "ShdPnd", "SigBlk", "SigCgt"))
                     + f", waits in {wchan}")
    log = Path(os.environ[warm_python.SOCKET_VARIABLE]).parent / "server.log"
    return "\n".join(lines) + "\nthe server's log ends:\n" + log.read_text()[-2000:]


def test_a_signal_to_the_client_reaches_the_process_and_a_killed_client_takes_it_along():
    start = [*warm_python.COMMAND, "-u", "-c", WAIT]
    client = subprocess.Popen(start, stdout=subprocess.PIPE, text=True, env=warm_python.environment())
    forked = forked_by_the_server(client)
    client.terminate()
    try:
        output = client.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        report = states(("client", client.pid), ("forked", forked.pid))
        client.kill(), forked.kill()
        pytest.fail(f"SIGTERM to the client did not end it and its process in 30 s:\n{report}")
    assert output == "SIGTERM\n" and client.returncode == 0, (output, client.returncode, states())
    client = subprocess.Popen(start, stdout=subprocess.PIPE, text=True, env=warm_python.environment())
    forked = forked_by_the_server(client)
    client.kill()
    client.wait(timeout=30)
    forked.wait(timeout=30)  # gone (the server reaps it: its exit code is the server's to read)
    client = subprocess.Popen(start, stdout=subprocess.PIPE, text=True, env=warm_python.environment())
    forked_by_the_server(client).kill()  # the process killed: its client dies of the same signal
    assert client.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while warm_python.forked_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert warm_python.forked_processes() == []
