"""torchrun on the CPU, forked: its launcher from a server that has imported every stack once, its
ranks from the launcher.

Started the plain way, every process of a run imports torch and megatron-core anew: about 3.4 s of CPU
for the launcher and 2.5 s a rank, most of a small run's cost. Here torchrun's own main
(torch.distributed.run) runs in a process forked from a server, started once for this megalign
process, that has imported torch, torchrun and each forking stack's `preload` (preloaded.py); the
launcher then forks each rank with torchrun's own `--start-method fork` and `--run-path`. One
`megalign forward` pays the imports once, as before; a process that launches many runs (a script of
several, the test suite) pays them once in all. Rendezvous, failure handling and logs stay torchrun's.

The launcher is what `python -m torch.distributed.run ARGS` would be: its own session (a signal to
its group stops every rank), stdout and stderr into one pipe, stdin from /dev/null, the run's
environment and working folder. `Launched` is the part of subprocess.Popen that launch.py watches.

Hand-written rather than multiprocessing's forkserver, which does the same but makes each child
import the parent's __main__ again: a user's script without a main guard would run twice.

CPU runs only: a process forked after CUDA is initialised cannot use CUDA; GPU runs start their
ranks as plain torchrun does.

    python -m megalign.run.forked FD    (the server, on the socket FD: started by `start`)
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import IO, Optional

from megalign.errors import RunFailed

class Launched:
    """A forked launcher, watched as launch.py watches a subprocess.Popen: its exit code arrives on
    `status` from the server, which reaps it."""

    def __init__(self, pid: int, stdout: IO[str], status: int):
        self.pid, self.stdout, self._status, self.returncode = pid, stdout, status, None

    def poll(self) -> Optional[int]:
        return self._read_status(0)

    def wait(self, timeout: Optional[float] = None) -> int:
        if self._read_status(timeout) is None:
            raise subprocess.TimeoutExpired("torchrun", timeout)
        return self.returncode

    def _read_status(self, timeout: Optional[float]) -> Optional[int]:
        if self.returncode is None and select.select([self._status], [], [], timeout)[0]:
            code = os.read(self._status, 16)
            os.close(self._status)
            if not code:  # the server is gone, and the launcher's fate with it: its group stopped for sure
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
            self.returncode = int(code) if code else -signal.SIGKILL
        return self.returncode


class _Server:
    """The preloaded process launchers are forked from. A session of its own, as each launcher: a signal
    to megalign's process group (a terminal's hang-up, `timeout`, a job's stop) is megalign's to handle.
    Killed with this process's exit; a launcher running then is stopped by launch.py first."""

    def __init__(self):
        self.socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Its own output is the preload's warnings (each launcher writes into its run's pipe instead).
        self.process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.lock = threading.Lock()
        atexit.register(self.close)

    def close(self) -> None:
        self.socket.close()
        self.process.kill()
        self.process.wait()

    def fork(self, torchrun_args: list[str], env: dict[str, str], timeout_s: float) -> Launched:
        """A launcher forked with `torchrun_args` and `env`; RunFailed where the server is gone, or does not
        answer within `timeout_s` (its imports hang)."""
        read, write = os.pipe()
        status_read, status_write = os.pipe()
        request_read, request_write = os.pipe()
        request = json.dumps({"args": torchrun_args, "env": env, "cwd": os.getcwd()}).encode()
        try:
            with self.lock:
                # The request through a pipe of its own: an environment may be larger than one socket message.
                with open(request_write, "wb") as requests:
                    try:
                        socket.send_fds(self.socket, [b"launch"], [request_read, write, status_write])
                    finally:  # the server's copies, or none: each closed here once
                        for fd in (request_read, write, status_write):
                            os.close(fd)
                    requests.write(request)
                self.socket.settimeout(timeout_s)
                pid = int(self.socket.recv(64) or b"0")
        except TimeoutError:
            self.close()
            raise RunFailed(f"timed out after {timeout_s:g} s (--timeout) while megalign's launcher server "
                            "imported torch and megatron-core") from None
        except OSError as e:
            pid = 0
            self.close()
            lost = f": {e.strerror or e}"
        else:
            lost = f" (exit code {self.process.poll()})"
        if not pid:
            os.close(read)
            os.close(status_read)
            raise RunFailed(f"megalign's launcher server (run/forked.py) is gone{lost}")
        return Launched(pid, io.TextIOWrapper(io.FileIO(read, "r"), errors="replace"), status_read)


_server: Optional[_Server] = None
_started = threading.Lock()


def start(torchrun_args: list[str], env: dict[str, str], timeout_s: float) -> Launched:
    """torchrun's main with `torchrun_args` in a launcher forked from the server (started on first use)."""
    global _server
    with _started:
        if _server is None or _server.process.poll() is not None:
            _server = _Server()
    return _server.fork(torchrun_args, env, timeout_s)


def serve(fd: int) -> None:
    """The server: each request on the socket forked into a launcher, each launcher's exit code written
    to its status pipe when it is reaped."""
    import megalign.run.preloaded  # noqa: F401 - what every launcher and rank imports, once

    requests = socket.socket(fileno=fd)
    wakeup, woken = os.pipe()
    os.set_blocking(wakeup, False)
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD wakes the selector
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the megalign process's to handle
    statuses: dict[int, int] = {}
    with selectors.DefaultSelector() as selector:
        selector.register(requests, selectors.EVENT_READ)
        selector.register(wakeup, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is wakeup:
                    os.read(wakeup, 4096)
                    _reap(statuses)
                    continue
                message, fds, _, _ = socket.recv_fds(requests, 64, 3)
                if not message:  # the megalign process is gone
                    return
                with open(fds[0], "rb") as request:
                    launch = json.loads(request.read())
                pid = os.fork()
                if pid == 0:  # the launcher: none of the server's own files
                    selector.close()
                    for fd in (requests.detach(), wakeup, woken, *statuses.values()):
                        os.close(fd)
                    _launch(launch, *fds[1:])
                statuses[pid] = fds[2]
                os.close(fds[1])
                requests.send(str(pid).encode())


def _reap(statuses: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in statuses:
            fd = statuses.pop(pid)
            os.write(fd, str(os.waitstatus_to_exitcode(status)).encode())
            os.close(fd)


def _launch(request: dict, output: int, status: int) -> None:
    """The forked launcher: torchrun's main, set up as a new process of its own would be; never returns."""
    code = 1
    try:
        os.close(status)
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for fd in (1, 2):
            os.dup2(output, fd)
        os.close(output)
        # Unbuffered, as PYTHONUNBUFFERED makes a new interpreter: the ranks' events are read as they come.
        sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                                   line_buffering=True) for fd in (1, 2))
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # TMPDIR is the run's (launch.py), not the one the server may have looked up
        os.chdir(request["cwd"])
        sys.argv = ["torchrun", *request["args"]]
        from torch.distributed.run import main

        main(request["args"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback, exit 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
