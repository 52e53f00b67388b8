"""`python -m megalign`: the same as the `megalign` command (and what torchrun can start)."""

from megalign.cli.app import main

main()
