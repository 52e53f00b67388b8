"""The megalign library: launching, workers, the dump format, reassembly, metrics and reports."""
