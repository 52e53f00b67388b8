"""megalign: find where two runs of the same large language model stop agreeing numerically.

The Python API (everything else is internal):

    megalign.open(path)     a dump, read as `megalign compare` reads it (compare/opened.py)
    megalign.Dumper(out)    write a megalign dump from any process (capture/dumper.py)
    megalign.Sharding       how a tensor given to Dumper.add is split over ranks

They are imported on first use: `import megalign` (and the CLI) stays free of torch.
"""

__version__ = "0.1.0"
__all__ = ["open", "Dumper", "Sharding"]

_EXPORTS = {"open": "megalign.compare.opened", "Dumper": "megalign.capture.dumper",
            "Sharding": "megalign.dump.sharding"}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megalign' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
