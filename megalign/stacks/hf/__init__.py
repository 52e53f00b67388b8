"""Hugging Face checkpoints on both stacks: loaded into megatron-core's GPTModel, and run through transformers.

    families.py    the supported architectures: config.json -> ModelConfig, and one name table each
    namemap.py     how a table's HF tensors become megatron's (fused QKV, fused gate/up), for weights,
                   gradients and activations alike
    checkpoint.py  reading and validating a checkpoint folder; the weights megatron's loader asks for
    worker.py      `--stack hf`: the same batch through transformers, written as a megalign dump
"""
