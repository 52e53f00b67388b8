"""`megalign backward`: forward and backward under megatron's DDP, gradients included."""

from megalign.cli.run import run_command

backward = run_command("backward")
