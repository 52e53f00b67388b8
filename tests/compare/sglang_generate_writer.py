"""A server's dump from transformers' `generate` (prefill, then decode steps with the KV cache) of two
requests batched together, on the real SmolLM2 checkpoint, written by sglang's own dumper code
(sglang_writer.load_sglang_dumper) through hooks that dump what sglang's Llama code, under the
dumper's non-intrusive hooks in `all` mode, dumps: per forward pass the forward batch's core
fields (input_ids, positions, seq_lens, req_pool_indices, rids), then every module's output under
`non_intrusive__<sglang module name>.output`, tokens back to back ([tokens of the pass, ...]).

Where sglang's modules differ from transformers', the hooks give what sglang's would: the norms
return (normed, residual) (but layer 0's input norm), the decoder layer (mlp output, residual),
`gate_up_proj` is gate|up, `act_fn` is SwiGLU (down_proj's input), o_proj's input is dumped as
`inputs.0`, and the logits processor returns each request's next-token logits.

`swap` swaps the two requests' rows of every activation in the last decode pass (two requests'
decode steps swapped); the forward batch is dumped as it was. Also writes OUT/tokens.json: the
tokens every pass fed the model, per request (the last generated token is never fed).

    python sglang_generate_writer.py OUT [swap]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from sglang_writer import load_sglang_dumper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real_checkpoint import build  # noqa: E402

RIDS = ("a", "b")
PROMPT_TOKENS = 6
NEW_TOKENS = 4


class Server:
    """Hooks on a transformers Llama that dump each forward pass as an sglang server's dumper would."""

    def __init__(self, dumper, swap_pass=None):
        self.dumper, self.swap_pass, self.passes = dumper, swap_pass, 0
        self.held = {}  # tensors a later hook dumps (gate_proj's output for gate_up_proj)

    def attach(self, model) -> None:
        model.register_forward_pre_hook(self.begin, with_kwargs=True)
        model.register_forward_hook(self.end)
        self.output(model.model.embed_tokens, "model.embed_tokens")
        for i, layer in enumerate(model.model.layers):
            name = f"model.layers.{i}"
            self.output(layer.input_layernorm, f"{name}.input_layernorm", residual=i > 0)
            self.output(layer.self_attn.o_proj, f"{name}.self_attn.o_proj", inputs=True)
            self.output(layer.self_attn, f"{name}.self_attn")
            self.output(layer.post_attention_layernorm, f"{name}.post_attention_layernorm", residual=True)
            layer.mlp.gate_proj.register_forward_hook(lambda m, a, out, i=i: self.held.update({i: out}))
            layer.mlp.up_proj.register_forward_hook(lambda m, a, out, n=name, i=i: self.dump(
                f"{n}.mlp.gate_up_proj.output", torch.cat([self.held.pop(i), out], -1)))
            layer.mlp.down_proj.register_forward_pre_hook(
                lambda m, args, n=name: self.dump(f"{n}.mlp.act_fn.output", args[0]))
            self.output(layer.mlp.down_proj, f"{name}.mlp.down_proj")
            self.output(layer.mlp, f"{name}.mlp")
            # (mlp output, residual): the residual is what the post-attention norm was given.
            layer.post_attention_layernorm.register_forward_pre_hook(
                lambda m, args, i=i: self.held.update({("residual", i): args[0]}))
            layer.register_forward_hook(lambda m, a, out, n=name, i=i: self.dump_tuple(
                f"{n}.output", (self.held.pop(("mlp", i)), self.held.pop(("residual", i)))))
            layer.mlp.register_forward_hook(lambda m, a, out, i=i: self.held.update({("mlp", i): out}))
        self.output(model.model.norm, "model.norm", residual=True)
        model.lm_head.register_forward_hook(lambda m, a, out: self.dumper.dump(
            "non_intrusive__logits_processor.output.next_token_logits", self.rows(out[:, -1:])))

    def output(self, module, name: str, residual: bool = False, inputs: bool = False) -> None:
        """`name`'s output as sglang's module returns it: with residual, (normed, its input)."""
        if inputs:
            module.register_forward_pre_hook(lambda m, args: self.dump(f"{name}.inputs.0", args[0]))

        def hook(m, args, out):
            out = out[0] if isinstance(out, tuple) else out
            if residual:
                self.dump_tuple(f"{name}.output", (out, args[0]))
            else:
                self.dump(f"{name}.output", out)

        module.register_forward_hook(hook)

    def dump_tuple(self, name: str, values) -> None:
        for index, value in enumerate(values):
            self.dump(f"{name}.{index}", value)

    def dump(self, name: str, value: torch.Tensor) -> None:
        self.dumper.dump(f"non_intrusive__{name}", self.rows(value))

    def rows(self, value: torch.Tensor) -> torch.Tensor:
        """[requests, tokens, ...] -> [tokens of the pass, ...], request after request."""
        if self.passes == self.swap_pass:
            value = value.flip(0)
        return value.reshape(-1, *value.shape[2:]).detach().clone()

    def begin(self, model, args, kwargs) -> None:
        ids = kwargs["input_ids"]
        positions = kwargs["position_ids"]  # [requests, tokens]: past the KV cache's in decode steps
        self.dumper.dump("input_ids", ids.reshape(-1).clone())
        self.dumper.dump("positions", positions.reshape(-1).clone())
        self.dumper.dump("seq_lens", positions[:, -1] + 1)
        self.dumper.dump("req_pool_indices", torch.arange(ids.shape[0]))
        self.dumper.dump("rids", list(RIDS))

    def end(self, model, args, out) -> None:
        self.passes += 1
        self.dumper.step()


def main(out: str, swap: bool = False) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint = build()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = torch.tensor([t[:PROMPT_TOKENS] for t in json.loads((checkpoint / "tokens.json").read_text())])
    dumper = load_sglang_dumper().dumper
    dumper.configure(enable=True, dir=out, exp_name="exp", enable_output_console=False)
    Server(dumper, swap_pass=NEW_TOKENS - 1 if swap else None).attach(model)
    with torch.no_grad():
        sequences = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                   max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, use_cache=True,
                                   pad_token_id=0)
    (Path(out) / "tokens.json").write_text(json.dumps(sequences[:, :-1].tolist()))


if __name__ == "__main__":
    main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "swap")
