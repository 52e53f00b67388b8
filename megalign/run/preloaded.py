"""Imported once, by forked.py's server before it forks any launcher: torchrun, and every forking
stack's CPU preload (what each of its ranks imports), so that launchers and ranks forked from the
server find them in place."""

import torch.distributed.run  # noqa: F401

from megalign.stacks import STACKS

for _stack in STACKS.values():
    if _stack.forks:
        try:
            _stack.preload("cpu")
        except Exception:  # noqa: BLE001 - each rank imports its stack again, and reports this failure as its own
            pass
