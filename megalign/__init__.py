"""megalign: find where two runs of the same large language model stop agreeing numerically."""

__version__ = "0.1.0"
