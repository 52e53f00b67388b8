"""The stacks a run can take, behind one protocol, so that run/ (launch, landing) knows none of them.

A stack is its worker module. `run_worker(spec)` runs one rank in the calling process: it writes
its tensors through megalign.Dumper into `spec.out` (a folder the launcher has claimed) and reports
progress and failures through events.py (`started`, `forward`/`backward`, `written` with tensors,
bytes and loss, `done`; `failed`). A stack that torchrun starts, one process a rank, also runs as
`python -m MODULE SPEC.json`; one whose worker has `preload(device)` (what every rank imports) can
have its CPU ranks forked from one process that called it (run/forked.py).

Kept free of imports: the launcher reads this table without paying any stack's import.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Stack:
    worker: str  # the worker module
    forks: bool = False  # its worker has preload(device), and its CPU ranks may be forked after it

    def run_worker(self, spec) -> None:
        importlib.import_module(self.worker).run_worker(spec)

    def preload(self, device: str) -> None:
        importlib.import_module(self.worker).preload(device)

    def worker_file(self) -> str:
        """The worker module's file, found without importing it (torchrun's --run-path runs a file)."""
        return importlib.util.find_spec(self.worker).origin


STACKS = {
    "megatron": Stack("megalign.stacks.megatron.worker", forks=True),  # megatron-core, one process a rank under torchrun
    "hf": Stack("megalign.stacks.hf.worker"),  # transformers, one rank in megalign's own process
}
