"""Starting the workers with torch's own launcher, watching them, and landing the dump atomically.

Workers write into `OUT.partial`; only when every rank has finished (dump.json written after a
barrier) is it renamed to OUT, so a failed, killed or timed-out run leaves nothing half-written.
The launcher runs in a process session of its own so that a timeout can stop every worker at once.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

from megalign.alignment import events
from megalign.alignment.config import RunSpec
from megalign.alignment.dump import DUMP_META
from megalign.alignment.errors import RunFailed, UserError


@dataclass(frozen=True)
class LaunchOptions:
    """torchrun's multi-node options, passed through as torchrun users expect them."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    rdzv_endpoint: Optional[str] = None
    overwrite: bool = False


@dataclass
class RunResult:
    out: Path
    seconds: float
    tensors: int = 0
    bytes: int = 0
    loss: Optional[float] = None
    ranks: int = 0


@dataclass
class _Watch:
    """What the launcher has heard from the workers so far."""

    failures: list[dict] = field(default_factory=list)
    written: dict[int, dict] = field(default_factory=dict)
    last_event: dict[int, str] = field(default_factory=dict)
    log: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))


def staging_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def torchrun_command(spec: RunSpec, spec_file: Path, options: LaunchOptions) -> list[str]:
    world = spec.layout.world_size
    if world % options.nnodes:
        raise UserError(f"world size {world} (tp*pp*cp) is not divisible by --nnodes {options.nnodes}")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world // options.nnodes}",
               f"--nnodes={options.nnodes}", f"--node-rank={options.node_rank}", "--max-restarts=0"]
    if options.rdzv_endpoint:
        command += ["--rdzv-backend=c10d", f"--rdzv-endpoint={options.rdzv_endpoint}", "--rdzv-id=megalign"]
    elif options.master_addr or options.nnodes > 1:
        command += [f"--master-addr={options.master_addr or '127.0.0.1'}",
                    f"--master-port={options.master_port or 29500}"]
    else:
        command += ["--standalone"]  # picks a free port: parallel runs on one machine do not collide
    return command + ["-m", "megalign.alignment.worker", str(spec_file)]


def worker_env(spec: RunSpec) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if spec.device == "cuda":
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
    return env


@contextlib.contextmanager
def staged(out: Path, overwrite: bool, owner: bool = True) -> Iterator[Path]:
    """Yield OUT.partial to write into; rename it to OUT once the block succeeds, remove it if not.

    Only the owner (node 0) creates, lands or removes the folder; other nodes' workers write into it.
    """
    staging = staging_dir(out)
    if owner:
        shutil.rmtree(staging, ignore_errors=True)  # a crashed earlier run's leftovers: ours by name
        staging.mkdir(parents=True)
    try:
        yield staging
        if owner:
            if out.exists() and overwrite:
                shutil.rmtree(out)
            os.replace(staging, out)
    except BaseException:
        if owner:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def launch(spec: RunSpec, options: LaunchOptions, on_event: Callable[[dict], None] = lambda e: None) -> RunResult:
    """Run the workers; return what they wrote, or raise UserError / RunFailed with the failing rank's story."""
    started = time.monotonic()
    owner = options.node_rank == 0
    with staged(Path(spec.out), options.overwrite, owner) as staging, \
            tempfile.NamedTemporaryFile("w", suffix=".json", prefix="megalign-spec-") as spec_file:
        spec_file.write(replace(spec, out=str(staging)).to_json())
        spec_file.flush()
        command = torchrun_command(spec, Path(spec_file.name), options)
        watch = _run(command, worker_env(spec), spec.timeout_s, on_event)
        if owner and not (staging / DUMP_META).is_file():
            raise RunFailed("the workers exited without writing dump.json", details=_tail(watch))
    result = RunResult(out=Path(spec.out), seconds=time.monotonic() - started, ranks=len(watch.written))
    for written in watch.written.values():
        result.tensors += written.get("tensors", 0)
        result.bytes += written.get("bytes", 0)
        if written.get("loss") is not None:
            result.loss = written["loss"]
    return result


def _run(command: list[str], env: dict, timeout_s: float, on_event: Callable[[dict], None]) -> _Watch:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               text=True, env=env, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True).start()
    watch = _Watch()
    deadline = time.monotonic() + timeout_s
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


def _stop(process: subprocess.Popen) -> None:
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
