"""megalign's megatron worker's capture: every module's output and its gradient, through capture/'s
walk of a megatron-core model (the Dumper's own on a user's model), with what only megalign's runs
add: the logits as their own kind, batch-first and cut to the real vocabulary, and the MoE routers'
decisions (kind routing).
"""

from __future__ import annotations

import torch

from megalign.capture.dumper import Dumper
from megalign.capture.hooks import Hooks
from megalign.capture.megatron_hooks import hook_megatron_model
from megalign.capture.megatron_names import global_name
from megalign.capture.adapter import View
from megalign.capture.megatron_adapter import logits_layout
from megalign.capture.megatron_outputs import LocalShape
from megalign.capture.megatron_router import RouterTrace
from megalign.dump.sharding import Sharding
from megalign.spec import ModelConfig

LOGITS_MODULE = "output_layer"  # its first output is the logits, [s, b, vocab/tp]


class ActivationCapture:
    """Registers hooks on every submodule of `model`; `remove()` takes them off again."""

    def __init__(self, model: torch.nn.Module, dumper: Dumper, model_config: ModelConfig, local: LocalShape,
                 grads: bool):
        self.dumper, self.grads = dumper, grads
        self.vocab_size, self.padded_vocab_size = model_config.vocab_size, model_config.padded_vocab_size(local.tp)
        self.hooks = Hooks()
        self.routers = RouterTrace(self.hooks, dumper, local)
        hook_megatron_model(self.hooks, model, self._record, lambda: local, named=lambda path: global_name(model, path),
                            router=self.routers.trace)

    def _record(self, key: str, name: str, tensor: torch.Tensor, sharding: Sharding, view: View) -> None:
        kind = "activation"
        if key == LOGITS_MODULE:
            # Logits are dumped batch-first, [b, s, vocab], the way every stack can write them.
            kind, key = "logits", "logits"
            sharding, view = logits_layout(sharding, self.vocab_size, self.padded_vocab_size)
        self.dumper.add_output(kind, key, tensor, sharding, view=view, module=name, grad=self.grads)

    def remove(self) -> None:
        self.hooks.remove()
        self.routers.remove()
