"""megalign's public Python API, re-exported by `megalign`: `open` reads a dump, `Dumper` writes one."""
