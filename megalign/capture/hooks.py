"""The one hook installer: every forward hook megalign puts on a model (the Dumper's, megalign's megatron
and transformers workers') is installed here, read a module's outputs one way, and comes off together.

A module's outputs are a tensor, or a tuple or list of them: output `index` of module `name` is named
`name` (index 0) or `name#index`; what is not a tensor (None, a dict) is passed over. A module whose
input is dumped too names it `name#input`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# (module, its output's name, the output, its index among the module's outputs)
OutputRecorder = Callable[[torch.nn.Module, str, torch.Tensor, int], None]


def output_name(module: str, index: int) -> str:
    return module if index == 0 else f"{module}#{index}"


def input_name(module: str) -> str:
    return f"{module}#input"


class Hooks:
    """The hooks installed on a model; `remove()` takes every one off."""

    def __init__(self):
        self._handles: list = []

    def on_outputs(self, module: torch.nn.Module, name: str, record: OutputRecorder, first: bool = False) -> None:
        """`record` each tensor `module` returns, named as output_name says; `first`: before the
        module's other forward hooks (those installed already, torch's tensor parallel styles', turn
        its output into a plain local tensor)."""
        def hook(module, inputs, output):
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for index, tensor in enumerate(outputs):
                if isinstance(tensor, torch.Tensor):
                    record(module, output_name(name, index), tensor, index)

        self._handles.append(module.register_forward_hook(hook, prepend=first))

    def on_input(self, module: torch.nn.Module, name: str,
                 record: Callable[[torch.nn.Module, str, torch.Tensor], None]) -> None:
        """`record` the first argument `module` is called with, as `name#input`."""
        def hook(module, inputs):
            record(module, input_name(name), inputs[0])

        self._handles.append(module.register_forward_pre_hook(hook))

    def before_call(self, module: torch.nn.Module, hook: Callable[[torch.nn.Module, tuple, dict], None]) -> None:
        """`hook(module, args, kwargs)` before each call of `module` (what a call says of the batch)."""
        self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def after_call(self, module: torch.nn.Module, hook: Callable[[torch.nn.Module, tuple, object], None]) -> None:
        """`hook(module, inputs, output)` after each call of `module`, its output whole (a router's)."""
        self._handles.append(module.register_forward_hook(hook))

    def around(self, module: torch.nn.Module, method: str, wrap: Callable[[Callable], Callable]) -> None:
        """`module.method` replaced by `wrap(module.method)` until remove(): a call inside the module's
        forward that no hook reaches (a router's gating). An instance attribute, so that removing it
        gives the module its class's method back."""
        setattr(module, method, wrap(getattr(module, method)))
        self._handles.append(_Replaced(module, method))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@dataclass(frozen=True)
class _Replaced:
    """around()'s handle: removing it takes the instance attribute off again."""

    module: torch.nn.Module
    method: str

    def remove(self) -> None:
        delattr(self.module, self.method)
