"""torchrun, its CPU ranks forked from one process that has imported their stack once.

Under plain torchrun every rank imports torch and megatron-core anew: about 2.5 s of CPU a rank,
most of a small run's cost (a tiny CP=2 backward: 10.3 s of CPU under torchrun, 5.5 s here, agent
and ranks together). This is torchrun's own main (torch.distributed.run), called after the stack's
`preload`, with torchrun's own `--start-method fork` and `--run-path`: the agent forks each rank,
which runs the worker's file as its __main__ with the imports already in place. Rendezvous,
failure handling and logs stay torchrun's.

CPU runs only: a process forked after CUDA is initialised cannot use CUDA, and an import may
initialise it; GPU runs start their ranks as plain torchrun does.

    python -m megalign.run.forked STACK DEVICE TORCHRUN_ARGS... (launch.torchrun_command)
"""

from __future__ import annotations

import sys

from torch.distributed.run import main as torchrun

from megalign.stacks import STACKS


def main(argv: list[str]) -> None:
    stack, device, *torchrun_args = argv
    STACKS[stack].preload(device)
    torchrun(torchrun_args)


if __name__ == "__main__":
    main(sys.argv[1:])
