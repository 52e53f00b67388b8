"""Parameter gradients after backward, with a coverage check so that an empty dump cannot pass.

Under megatron's DDP the gradient lives in `param.main_grad` and `param.grad` is None: a dumper
that reads only `.grad` writes nothing. Reading `.grad` and falling back to `main_grad` is right
for both wrapped and bare models; `--grad-source grad` keeps the classic mistake reachable.

With the distributed optimizer, DDP reduce-scatters each gradient bucket over the DP (x CP) ranks:
each rank holds the reduced values of its shard only, the rest of the buffer its own unreduced
gradients. The full gradients are the shards all-gathered, as `Dumper.step` gathers a user's
(capture/megatron_adapter.py: into fresh memory, the buckets left as they are); `--grad-source shard` reads
only the rank's own shard, the other classic mistake, and coverage then names the parameters that
lie outside it.

An expert that no token of the step reached has a gradient of zeros, legitimately: few tokens (a
short batch, a small test model) leave some experts idle, and so does a token whose output the loss
never reads (a sequence's last). The gradients of the routers' probabilities, counted over every
rank, say which: those gradients are dumped as the zeros they are, any other all-zero one is missing.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from megalign.capture.coverage import check_coverage, collective_device
from megalign.capture.ddp_grads import held_gradients
from megalign.capture.dumper import Dumper
from megalign.capture.megatron_adapter import param_grad_layout, param_sharding, read_grads
from megalign.capture.megatron_names import expert_of, global_name, is_duplicate_embedding
from megalign.capture.megatron_outputs import is_router
from megalign.dump.format import Kind
from megalign.spec import RunSpec


_ROUTER = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.router$")


class ExpertTokens:
    """How many tokens each decoder layer's router sent to each expert whose output the loss reached:
    the gradient of the router's probabilities, [tokens, experts], is nonzero where a token was sent
    to the expert and its output took part in the loss (a sequence's last token sends its experts
    nothing back, nor, in the last MoE layer, does a token the loss mask leaves out). Counted by a
    hook on each router's output in the step's backward (where activations are recomputed, on the
    recomputed forward's, the first having no graph), on the device (a read-back a layer would stall
    the backward), so an expert counted zero is one whose gradient is zeros."""

    def __init__(self, model: torch.nn.Module, layers: int, experts: int):
        self.counts = torch.zeros(layers, experts, dtype=torch.int64, device=collective_device())
        self._handles = []
        for local, module in model.named_modules():
            match = is_router(module) and _ROUTER.match(global_name(model, local))
            if match:  # an MTP layer's router is not counted: its experts' zeros stay missing
                self._handles.append(module.register_forward_hook(self._hooker(int(match.group(1)))))
        if not self._handles and any(expert_of(global_name(model, name)) for name, _ in model.named_parameters()):
            # Every expert would count as unreached, and every missing gradient of one be excused.
            raise RuntimeError("experts, and no router of theirs found to count their tokens (megatron-core's names?)")

    def _hooker(self, layer: int):
        def count(grad: torch.Tensor) -> None:
            self.counts[layer] += (grad != 0).sum(0).to(self.counts.device)

        def hook(module, inputs, output) -> None:
            probs = output[0]  # [tokens, experts], zero where not chosen (megatron_outputs.routing_choices)
            if probs.requires_grad:
                probs.register_hook(count)
        return hook

    def unreached(self) -> set[tuple[int, int]]:
        """(layer, expert) that no token of any rank reached: every rank calls it, once, after backward."""
        for handle in self._handles:
            handle.remove()
        dist.all_reduce(self.counts)
        return {(layer, expert) for layer, expert in (self.counts == 0).nonzero().tolist()}


def collect_param_grads(chunk: torch.nn.Module, model: torch.nn.Module, dumper: Dumper, spec: RunSpec,
                        experts: ExpertTokens | None = None) -> dict:
    """Dump every parameter's gradient, read as the Dumper reads a user's (megatron_adapter.read_grads,
    from `chunk`, the DDP-wrapped `model`) and held by the same rule; raise RunFailed naming the first
    parameters without one, other than the experts that `experts` says no token reached (counted in
    the manifest's record)."""
    params = {}
    for local, param in model.named_parameters():
        name = global_name(model, local)
        if not is_duplicate_embedding(name, param):  # the first stage dumps the word embeddings' gradient
            params[name] = param
    grads = read_grads([chunk], params, spec.grad_source)
    vocab, padded = spec.model.vocab_size, spec.model.padded_vocab_size(spec.layout.tp)
    missing, present, unreached = [], 0, 0
    idle = experts.unreached() if experts is not None else set()
    for (name, grad), holds in zip(grads.items(), held_gradients(list(grads.values()), list(params.values()))):
        if not holds:
            if expert_of(name) not in idle:
                missing.append(name)
                continue
            unreached += 1
        if grad is None:  # an idle expert's, where no buffer holds it: its gradient is zeros all the same
            grad = torch.zeros_like(params[name])
        present += 1
        grad, sharding = param_grad_layout(name, grad, param_sharding(name, params[name], spec.model.swiglu),
                                           vocab, padded)
        dumper.add(Kind.PARAM_GRAD, name, grad, sharding, module=name.rsplit(".", 1)[0], stable=True)
    coverage = check_coverage(missing, len(missing) + present, spec.grad_source)
    return {**coverage, "zeros_of_unreached_experts": unreached} if unreached else coverage
