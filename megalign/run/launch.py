"""Starting a stack's workers with torch's own launcher, or one rank in this process, watching them,
and landing the dump atomically.

Which worker runs is the stack's (stacks/__init__.py): nothing here knows one stack from another.
Workers write into the staging folder (dump/landing.py), which becomes OUT only when every rank has
finished (dump.json written after a barrier). The launcher runs in a process session of its own so
that a timeout, Ctrl-C, SIGTERM or SIGHUP stops every worker at once; its spec file and torchrun's
logs live in one temporary folder of megalign's, removed at the end.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

from megalign.dump.format import DUMP_META
from megalign.dump.landing import staged
from megalign.errors import RunFailed, UserError
from megalign.options import Launch
from megalign.run import forked
from megalign.spec import RunSpec
from megalign.stacks import STACKS, events


@dataclass
class RunResult:
    out: Path
    seconds: float
    tensors: int = 0
    bytes: int = 0
    loss: Optional[float] = None
    ranks: int = 0
    landed: bool = True  # False on nodes other than 0: node 0 renames the staging folder to OUT


@dataclass
class _Watch:
    """What the launcher has heard from the workers so far."""

    failures: list[dict] = field(default_factory=list)
    written: dict[int, dict] = field(default_factory=dict)
    last_event: dict[int, str] = field(default_factory=dict)
    log: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))


def check_options(spec: RunSpec, options: Launch) -> None:
    world = spec.layout.world_size
    if options.nnodes < 1:
        raise UserError(f"--nnodes must be at least 1, got {options.nnodes}")
    if not 0 <= options.node_rank < options.nnodes:
        raise UserError(f"--node-rank {options.node_rank} is not in [0, --nnodes {options.nnodes})")
    if world % options.nnodes:
        raise UserError(f"world size {world} (tp*pp*cp) is not divisible by --nnodes {options.nnodes}")


@dataclass(frozen=True)
class Torchrun:
    """How a run's ranks start: torchrun with `args` (its own, then the worker's)."""

    args: list[str]
    forked: bool  # torchrun's main in a launcher forked from a preloaded server (forked.py), ranks forked from it

    def start(self, env: dict, timeout_s: float) -> "subprocess.Popen | forked.Launched":
        if self.forked:
            return forked.start(self.args, env, timeout_s)
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *self.args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env,
                                start_new_session=True)


def torchrun_command(spec: RunSpec, stack: str, spec_file: Path, log_dir: Path, options: Launch) -> Torchrun:
    world = spec.layout.world_size
    torchrun = [f"--nproc-per-node={world // options.nnodes}", f"--nnodes={options.nnodes}",
                f"--node-rank={options.node_rank}", "--max-restarts=0", f"--log-dir={log_dir}"]
    if options.rdzv_endpoint:
        torchrun += ["--rdzv-backend=c10d", f"--rdzv-endpoint={options.rdzv_endpoint}", "--rdzv-id=megalign"]
    elif options.master_addr or options.nnodes > 1:
        torchrun += [f"--master-addr={options.master_addr or '127.0.0.1'}",
                     f"--master-port={options.master_port or 29500}"]
    else:
        torchrun += ["--standalone"]  # picks a free port: parallel runs on one machine do not collide
    worker = STACKS[stack]
    if worker.forks and spec.device == "cpu":  # the launcher and ranks forked after one import of the stack
        return Torchrun([*torchrun, "--start-method=fork", "--run-path", worker.worker_file(), str(spec_file)], True)
    return Torchrun([*torchrun, "-m", worker.worker, str(spec_file)], False)


def worker_env(spec: RunSpec) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if spec.device == "cuda":
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
    return env


# Each unwinds like Ctrl-C, so that workers are stopped and staging is removed.
INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt. After the first, the others are ignored
    until the process exits: a second Ctrl-C would break off the cleanup (workers left running, a
    folder half removed) or print a traceback from the exit handlers."""

    def interrupt(signum, frame):
        for sig in INTERRUPTS:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in INTERRUPTS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is interrupt:  # not once interrupted: the process is on its way out
                signal.signal(sig, handler)


def launch(spec: RunSpec, stack: str, options: Launch, overwrite: bool,
           on_event: Callable[[dict], None] = lambda e: None) -> RunResult:
    """Run `stack`'s workers under torchrun; return what they wrote, or raise UserError / RunFailed with
    the failing rank's story."""
    check_options(spec, options)
    started = time.monotonic()
    owner = options.node_rank == 0
    with staged(Path(spec.out), overwrite, owner) as staging, _staged_save(spec.save, owner) as save, \
            tempfile.TemporaryDirectory(prefix="megalign-") as scratch:
        spec_file = Path(scratch) / "spec.json"
        spec_file.write_text(replace(spec, out=str(staging), save=save and str(save)).to_json())
        command = torchrun_command(spec, stack, spec_file, Path(scratch) / "torchrun-logs", options)
        # Temporary files of the launcher's and the ranks' (torch's multiprocessing leaves its error files
        # behind when a signal stops the ranks) go into the scratch folder, and so with it.
        watch = _run(command, dict(worker_env(spec), TMPDIR=scratch), spec.timeout_s, on_event)
        if owner and not (staging / DUMP_META).is_file():
            raise RunFailed("the workers exited without writing dump.json", details=_tail(watch))
    return gather_result(Path(spec.out) if owner else staging, time.monotonic() - started, watch.written.values(),
                         landed=owner)


def _staged_save(save: Optional[str], owner: bool):
    """--save's checkpoint lands like the dump (never over a folder of the user's), just before it."""
    if save is None:
        return contextlib.nullcontext()
    return staged(Path(save), False, owner, flag="--save")


def gather_result(out: Path, seconds: float, written, landed: bool = True) -> RunResult:
    """A run's result from its ranks' `written` events."""
    result = RunResult(out=out, seconds=seconds, landed=landed)
    for event in written:
        result.ranks += 1
        result.tensors += event.get("tensors", 0)
        result.bytes += event.get("bytes", 0)
        if event.get("loss") is not None:
            result.loss = event["loss"]
    return result


# Events every rank emits at the same point of the run: under --launcher none they are gathered to
# rank 0 with one small collective each, so that rank 0 can show every rank's progress.
GATHERED = ("started", "forward", "backward", "written")


def run_here(spec: RunSpec, stack: str, on_event: Callable[[dict], None]) -> Optional[RunResult]:
    """--launcher none: this process is one rank of the user's own torchrun/srun. Every rank's
    progress reaches `on_event` on rank 0; rank 0 returns the result, the other ranks None."""
    import torch.distributed as dist

    world = os.environ.get("WORLD_SIZE")
    if not world:
        raise UserError("--launcher none expects RANK and WORLD_SIZE from your torchrun/srun")
    if int(world) != spec.layout.world_size:
        raise UserError(f"WORLD_SIZE={world} but tp*pp*cp={spec.layout.world_size}")
    rank, written = int(os.environ.get("RANK", "0")), []

    def sink(event: dict) -> None:
        heard = [event]
        if event["event"] in GATHERED:
            heard = [None] * int(world)
            dist.all_gather_object(heard, event)
        if rank == 0:
            for one in heard:
                on_event(one)
                if one["event"] == "written":
                    written.append(one)

    started = time.monotonic()
    _in_this_process(spec, stack, sink)
    return gather_result(Path(spec.out), time.monotonic() - started, written) if rank == 0 else None


def run_in_process(spec: RunSpec, stack: str, overwrite: bool) -> RunResult:
    """A stack that runs as one rank in this process (--stack hf), staged and landed like a launched run."""
    started, written = time.monotonic(), []

    def sink(event: dict) -> None:
        if event["event"] == "written":
            written.append(event)

    with staged(Path(spec.out), overwrite) as staging:
        _in_this_process(replace(spec, out=str(staging)), stack, sink)
    return gather_result(Path(spec.out), time.monotonic() - started, written)


def _in_this_process(spec: RunSpec, stack: str, sink: Callable[[dict], None]) -> None:
    """One rank of `stack`'s worker in this process, its events going to `sink`."""
    events.set_sink(sink)
    try:
        STACKS[stack].run_worker(spec)
    finally:
        events.set_sink(events.print_line)


def _run(command: Torchrun, env: dict, timeout_s: float, on_event: Callable[[dict], None]) -> _Watch:
    deadline = time.monotonic() + timeout_s
    process = command.start(env, timeout_s)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True).start()
    watch = _Watch()
    try:
        while True:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                line = None
            if line is None and process.poll() is not None and lines.empty():
                break
            if time.monotonic() > deadline:
                _stop(process)
                stuck = sorted(r for r, e in watch.last_event.items() if e != "done")
                raise RunFailed(f"timed out after {timeout_s:g} s (--timeout); all workers stopped"
                                + (f"; ranks still running: {stuck}" if stuck else ""), details=_tail(watch))
            if line is not None:
                _hear(line, watch, on_event)
    except BaseException:
        _stop(process)
        raise
    if process.returncode != 0:
        raise _failure(watch, process.returncode)
    return watch


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))


def _hear(line: str, watch: _Watch, on_event: Callable[[dict], None]) -> None:
    event = events.parse(line)
    if event is None:
        watch.log.append(line)
        return
    watch.last_event[event["rank"]] = event["event"]
    if event["event"] == "failed":
        watch.failures.append(event)
    elif event["event"] == "written":
        watch.written[event["rank"]] = event
    on_event(event)


def _failure(watch: _Watch, returncode: int) -> Exception:
    if not watch.failures:
        return RunFailed(f"the workers failed (launcher exit code {returncode}) before reporting an error",
                         details=_tail(watch))
    first = watch.failures[0]  # the first to fail; the others usually fail because it left
    if first.get("user_error"):
        return UserError(first["error"])
    return RunFailed(f"rank {first['rank']} failed: {first['error']}", details=first.get("traceback", ""))


def _stop(process: "subprocess.Popen | forked.Launched") -> None:
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(watch: _Watch) -> str:
    return "\n".join(list(watch.log)[-40:])
