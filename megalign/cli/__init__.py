"""megalign's command line: a Typer app, one module per command, rendering with rich."""
