"""Which command starts a run's ranks (run/launch.py torchrun_command): no processes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from conftest import run_key

from megalign.options import Launch
from megalign.run.launch import Torchrun, torchrun_command
from megalign.run.plan import plan_run


def command(device: str) -> Torchrun:
    spec = replace(plan_run(run_key("forward", "--cp", "2")), device=device)
    return torchrun_command(spec, "megatron", Path("spec.json"), Path("logs"), Launch())


def test_cpu_ranks_are_forked_by_torchrun_after_one_import_of_megatron():
    cmd = command("cpu")
    assert cmd.forked and "--start-method=fork" in cmd.args and "--nproc-per-node=2" in cmd.args
    assert cmd.args[-3] == "--run-path" and Path(cmd.args[-2]).parts[-3:] == ("stacks", "megatron", "worker.py")


def test_gpu_ranks_start_as_plain_torchrun_starts_them():
    """A rank forked after CUDA is initialised could not use it."""
    cmd = command("cuda")
    assert not cmd.forked and "--start-method=fork" not in cmd.args
    assert cmd.args[-3:] == ["-m", "megalign.stacks.megatron.worker", "spec.json"]
