"""`megalign forward`: a forward-only run (no DDP wrapping, model.train(False))."""

from megalign.cli.run import run_command

forward = run_command("forward")
