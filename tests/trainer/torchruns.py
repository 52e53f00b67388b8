"""Launching a user's training script under torchrun on gloo, as a user does, dumping through
MEGALIGN_DUMP (megalign.Dumper.from_env in the script)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[2]


def start(out: Path, *args: str, script: Path, steps: str = "", ranks: int = 2, fork: bool = True) -> subprocess.Popen:
    """`script` under torchrun with `ranks` gloo ranks, dumping into `out` (MEGALIGN_DUMP). `fork`: with
    torchrun's own `--start-method fork --run-path`, each rank forked from torchrun's process, which has
    imported torch (1.5 s of CPU a rank); the script runs as its __main__ all the same."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MEGALIGN_DUMP": str(out)}
    env.pop("MEGALIGN_DUMP_STEPS", None)
    if steps:
        env["MEGALIGN_DUMP_STEPS"] = steps
    forked = ["--start-method", "fork", "--run-path"] if fork else []
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(ranks), *forked, str(script), *args], cwd=out.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(*runs: subprocess.Popen) -> None:
    for run in runs:
        output, _ = run.communicate(timeout=300)
        assert run.returncode == 0, output[-4000:]


def refused(out: Path, *args: str, script: Path, ranks: int) -> str:
    """The output of a run of `script` that must fail, having left no dump in `out`. (Rank 0's staging
    folder may remain, torchrun having stopped it before it removed it: its marker names a process
    gone, and the next run clears it.) Each rank started anew, as `torchrun script.py` starts them: forked
    ranks, torchrun stops the others once the first has failed, before they print their own error."""
    run = start(out, *args, script=script, ranks=ranks, fork=False)
    output, _ = run.communicate(timeout=300)
    assert run.returncode != 0, output[-4000:]
    assert not out.exists()
    return output


def dump_all(root: Path, script: Path, runs: dict[str, tuple[int, tuple[str, ...]]],
             steps: str = "") -> dict[str, Path]:
    """Every run of `script` (name: its ranks and arguments) side by side, each dumping into root/name
    (`steps`: MEGALIGN_DUMP_STEPS)."""
    made = {name: root / name for name in runs}
    finish(*(start(made[name], *args, script=script, ranks=ranks, steps=steps) for name, (ranks, args) in runs.items()))
    return made
