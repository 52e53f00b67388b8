"""The few patches megatron-core needs to run on a CPU (gloo), or without TransformerEngine, in one place.

megatron-core assumes CUDA in a handful of functions, and TE for one index computation. Each patch below names the megatron-core
function or attribute it replaces; `apply_cpu_patches` is called only when a run is on the CPU,
and tests/test_cpu_patches.py fails loudly when an installed megatron-core no longer has a target
(so a version bump cannot silently leave a patch pointing at nothing).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from typing import Callable

import torch

# megatron/core/transformer/moe/ops/paged_stash.py imports triton unguarded and is reached from
# `import megatron.core`. A stub of that one module avoids a 286 MB wheel; a fake top-level
# `triton` package would break torch._dynamo (shared/NOTES.md).
PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def install_import_stubs() -> None:
    """Call before the first `import megatron.core`. A no-op where triton is installed."""
    if PAGED_STASH in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(PAGED_STASH)
    stub.GLOBAL_BLOCK_SIZE = 1024

    def unavailable(*args, **kwargs):
        raise RuntimeError("megatron-core's paged-stash triton kernels are not available on the CPU")

    stub.paged_stash_copy_kernel = unavailable
    stub.paged_stash_pop_kernel = unavailable
    sys.modules[PAGED_STASH] = stub


_MISSING = object()


@dataclass(frozen=True)
class Patch:
    targets: tuple[str, ...]  # "module:attribute" (or "module:Class.method") names this patch replaces
    why: str
    apply: Callable[[], None]

    def check(self) -> None:
        """Raise if an installed megatron-core (or torch) no longer has a target."""
        install_import_stubs()
        for target in self.targets:
            module_name, path = target.split(":")
            owner = importlib.import_module(module_name)
            for attr in path.split("."):
                owner = getattr(owner, attr, _MISSING)
            if owner is _MISSING:
                raise RuntimeError(f"CPU patch target {target} no longer exists ({self.why}); "
                                   f"megalign's cpu_patches needs updating for this megatron-core")


def _cpu_current_device():
    torch.cuda.current_device = lambda: "cpu"


def _cpu_rng_tracker():
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    mrandom.CudaRNGStatesTracker.add = add


def _cpu_causal_mask():
    from megatron.core.fusions import fused_softmax

    # fused_softmax imported the function by name, so its reference is the one to replace.
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_mask():
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    get_sliding_window_causal_mask = _on_cpu(utils.get_sliding_window_causal_mask)
    # fused_softmax imported it by name: both references are replaced.
    for module in (utils, fused_softmax):
        module.get_sliding_window_causal_mask = get_sliding_window_causal_mask


def _expert_fc2_bias_out_of_place():
    from megatron.core.transformer.mlp import MLP

    init = MLP.__init__

    def __init__(self, config, submodules, *args, **kwargs):
        init(self, config, submodules, *args, **kwargs)
        # An expert adds its fc2 bias, scaled by the routing weight, in place on fc2's output: a view made
        # inside the linear's autograd Function, which backward refuses. A copy computes the same.
        if self.config.add_bias_linear and getattr(self.linear_fc2, "is_expert", False):
            self.linear_fc2.register_forward_hook(lambda module, inputs, output: (output[0].clone(), *output[1:]))

    MLP.__init__ = __init__


def _cpu_streams():
    torch.cuda.current_stream = lambda *args, **kwargs: torch.cpu.current_stream()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.Stream = _HostStream
    torch.cuda.stream = torch.cpu.stream


class _HostStream(torch.cpu.Stream):
    """torch.cpu.Stream's record_event returns None; on the CPU work is done when a call returns, so an
    event that is always complete is exact."""

    def record_event(self, event=None):
        return torch.Event("cpu")


def _cpu_rope_cp_slice():
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    from megalign.dump.layout import zigzag_chunks

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        index = torch.tensor(zigzag_chunks(cp_rank, cp_size), device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, index)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    for module in (rope_utils, rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


def _cpu_schedules():
    from megatron.core.pipeline_parallel import schedules

    for name in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving"):
        setattr(schedules, name, _on_cpu(getattr(schedules, name)))


def _cpu_optimizer():
    import megatron.core.optimizer as optimizer
    from megatron.core.optimizer import optimizer as classes

    optimizer.get_megatron_optimizer = _on_cpu(optimizer.get_megatron_optimizer, cuda_type_names=True)
    for cls in (classes.MixedPrecisionOptimizer, classes.FP32Optimizer, classes.ChainedOptimizer):
        cls.step = _on_cpu(cls.step, cuda_type_names=True)


def _cpu_tied_embeddings():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _on_cpu(LanguageModule.setup_embeddings_and_output_layer)


def _cpu_moe_splits():
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        # The split sizes of the all-to-all leave the GPU as numpy arrays; already on the CPU they stayed
        # tensors, which all_to_all_single does not take as split sizes.
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _cpu_uneven_collectives():
    """gloo's all_gather and reduce_scatter take equal sizes only; megatron's expert-TP path calls them
    with per-rank split sizes. The same results on gloo: pieces padded to the largest and gathered; the
    reduce-scatter as an all-reduce of which each rank keeps its piece."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        gathered = input_.new_empty((longest * group.size(), *input_.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded.contiguous(), group=group)
        return torch.cat([piece[:size] for piece, size in zip(gathered.split(longest), output_split_sizes)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.split(list(input_split_sizes))[group.rank()].clone()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def _cpu_no_compile():
    # torch.compile's device checks call torch.cuda.current_device, which the CPU run answers "cpu".
    torch._dynamo.config.disable = True


def _thd_partitioned_indices():
    from megatron.core import utils

    from megalign.dump.layout import cp_positions

    if utils.tex is not None:
        return  # TransformerEngine is installed: its kernel is the one training uses

    def thd_get_partitioned_indices(cu_seqlens, total_tokens, world_size, rank):
        return cp_positions(cu_seqlens.tolist(), rank, world_size, device=cu_seqlens.device)

    utils.tex = types.SimpleNamespace(thd_get_partitioned_indices=thd_get_partitioned_indices)


def _mla_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megalign.stacks.megatron.cp_attention import ZigzagCPAttention

    init = MLASelfAttention.__init__

    def __init__(self, config, submodules, *args, **kwargs):
        # MLA's keys are qk_head_dim + qk_pos_emb_head_dim wide and its values v_head_dim: the local
        # attention sizes both from kv_channels and refuses the two widths; megalign's takes them.
        if submodules.core_attention is DotProductAttention:
            submodules.core_attention = ZigzagCPAttention
        init(self, config, submodules, *args, **kwargs)

    MLASelfAttention.__init__ = __init__


def _mla_norms_without_q_lora():
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

    resolve = QKNormConfigResolver.resolve

    def resolve_without_q_lora(self):
        # Without q_lora_rank there is no q latent to norm: the resolver refuses the local spec's q norm, then
        # asks for TE's fused norm+linear on linear_q_proj. The plain linear and the spec's kv norm compute
        # what transformers does.
        if self.has_q_lora or self.is_dsa or not self.config.qk_layernorm or \
                self._is_fused_norm_linear(self.submodules.linear_q_proj):
            return resolve(self)
        return self._result(
            linear_q_proj=self._non_fused_or_default(self.submodules.linear_q_proj, "linear_q_proj"),
            linear_q_up_proj=IdentityOp, q_layernorm=IdentityOp,
            linear_kv_up_proj=self._non_fused_or_default(self.submodules.linear_kv_up_proj, "linear_kv_up_proj"),
            kv_layernorm=self.submodules.kv_layernorm)

    QKNormConfigResolver.resolve = resolve_without_q_lora


def _on_cpu(schedule, cuda_type_names: bool = False):
    """Run a schedule (or any megatron function) with `device="cuda"` allocations, `.cuda()` and pinned memory sent to the CPU.
    `cuda_type_names`: a CPU tensor's `.type()` also answers `torch.cuda.FloatTensor` (and so on) inside the call, for the
    optimizer's checks that its parameters are on a GPU; never outside it."""
    from torch.overrides import TorchFunctionMode

    def is_cuda(device) -> bool:
        return isinstance(device, (str, torch.device)) and str(device).startswith("cuda")

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                return args[0]
            if cuda_type_names and func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
            if is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            return func(*args, **kwargs)

    def run(*args, **kwargs):
        with CudaToCpu():
            return schedule(*args, **kwargs)

    return run


NO_COMPILE = Patch(("torch._dynamo.config:disable",),
                   "megatron's jit_fuser compiles the MoE router's expert-bias step; on a host with CUDA, "
                   "torch.compile then asks the patched torch.cuda.current_device for device properties",
                   _cpu_no_compile)

UNEVEN_COLLECTIVES = Patch(("megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
                            "megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim"),
                           "with expert tensor parallelism the MoE dispatcher gathers and reduce-scatters pieces of "
                           "different sizes, which gloo does not take", _cpu_uneven_collectives)

MOE_SPLITS = Patch(("megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",),
                   "the all-to-all dispatcher turns its split sizes into numpy arrays only when they are on a GPU",
                   _cpu_moe_splits)

THD_PARTITION = Patch(("megatron.core.utils:tex",),
                      "packed (THD) batches are split over CP ranks document by document with TE's "
                      "thd_get_partitioned_indices; without TE, the same indices computed in torch",
                      _thd_partitioned_indices)

MLA_CORE_ATTENTION = Patch(("megatron.core.transformer.multi_latent_attention:MLASelfAttention.__init__",
                            "megatron.core.transformer.dot_product_attention:DotProductAttention"),
                           "MLASelfAttention passes k_channels/v_channels to its core attention, which the local "
                           "DotProductAttention does not take (a TypeError at build)", _mla_core_attention)

MLA_NORMS_WITHOUT_Q_LORA = Patch(
    ("megatron.core.transformer.mla_qk_norm_config:QKNormConfigResolver.resolve",
     "megatron.core.transformer.mla_qk_norm_config:QKNormConfigResolver._non_fused_or_default",
     "megatron.core.transformer.mla_qk_norm_config:QKNormConfigResolver._is_fused_norm_linear",
     "megatron.core.transformer.mla_qk_norm_config:QKNormConfigResolver._result"),
    "with q_lora_rank null the MLA norm resolver asks for TransformerEngine's fused norm+linear "
    "(transformer/mla_qk_norm_config.py)", _mla_norms_without_q_lora)

EXPERT_FC2_BIAS = Patch(("megatron.core.transformer.mlp:MLP.__init__",),
                        "with biased experts (GPT-OSS) the expert MLP adds its fc2 bias in place on the linear's "
                        "output, a view autograd refuses to modify in backward (local spec, CPU or GPU)",
                        _expert_fc2_bias_out_of_place)

PATCHES: tuple[Patch, ...] = (
    Patch(("torch.cuda:current_device",), "model build asks for the current CUDA device", _cpu_current_device),
    Patch(("megatron.core.tensor_parallel.random:CudaRNGStatesTracker",
           "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
           "megatron.core.tensor_parallel.random:_set_cuda_rng_state"),
          "the RNG tracker saves and restores CUDA generator states", _cpu_rng_tracker),
    Patch(("megatron.core.fusions.fused_softmax:get_default_causal_mask",),
          "transformer/utils.py builds the causal mask with device='cuda'", _cpu_causal_mask),
    Patch(("megatron.core.transformer.utils:get_sliding_window_causal_mask",
           "megatron.core.fusions.fused_softmax:get_sliding_window_causal_mask"),
          "transformer/utils.py builds the sliding-window mask with device='cuda'", _cpu_sliding_window_mask),
    Patch(("torch.cuda:current_stream", "torch.cuda:synchronize", "torch.cuda:Stream", "torch.cuda:stream"),
          "DDP's start_grad_sync waits on the current CUDA stream; PP's p2p _communicate synchronizes CUDA; the "
          "MoE all-to-all dispatcher makes a side stream for its device-to-host copies",
          _cpu_streams),
    Patch(("megatron.core.models.common.embeddings.rope_utils:get_pos_emb_on_this_cp_rank",
           "megatron.core.models.common.embeddings.rotary_pos_embedding:get_pos_emb_on_this_cp_rank"),
          "slices RoPE per CP rank through pinned memory and .cuda()", _cpu_rope_cp_slice),
    Patch(("megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining",
           "megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving"),
          "the schedules allocate total_num_tokens (and PP's p2p buffers) with device='cuda'", _cpu_schedules),
    Patch(("megatron.core.models.common.language_module.language_module:LanguageModule."
           "setup_embeddings_and_output_layer",),
          "with tied embeddings under PP the last stage's copy of the embeddings is moved with .cuda() before "
          "its all-reduce", _cpu_tied_embeddings),
    Patch(("megatron.core.optimizer:get_megatron_optimizer",
           "megatron.core.optimizer.optimizer:MixedPrecisionOptimizer.step",
           "megatron.core.optimizer.optimizer:FP32Optimizer.step",
           "megatron.core.optimizer.optimizer:ChainedOptimizer.step"),
          "the optimizer (a user's training loop) allocates its found-inf flag and grad-norm buffers with "
          "device='cuda' and checks that its parameters' .type() is a torch.cuda one", _cpu_optimizer),
    MOE_SPLITS,
    NO_COMPILE,
    UNEVEN_COLLECTIVES,
    THD_PARTITION,
    MLA_CORE_ATTENTION,
    MLA_NORMS_WITHOUT_Q_LORA,
    EXPERT_FC2_BIAS,
)

_applied = False


def apply_te_stand_ins() -> None:
    """On CUDA: the stand-ins needed where TransformerEngine is not installed (THD's a no-op where it is)."""
    for patch in (THD_PARTITION, EXPERT_FC2_BIAS):
        patch.check()
        patch.apply()


def apply_cpu_patches() -> None:
    """Everything megatron-core needs on a CPU: a user's script that runs megatron-core on gloo calls
    this once, first (before its own `import megatron.core`), where a GPU would need nothing."""
    global _applied
    if _applied:
        return
    for patch in PATCHES:
        patch.check()
        patch.apply()
    _applied = True
