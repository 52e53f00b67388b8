"""`--plot FILE.png`: the relative difference per layer, one series per kind of tensor.

Each point is the largest relative difference among the tensors of that kind in that layer (a
layer's output, its submodules, its parameters). Tensors outside the layers (embedding, final
norm, output layer) have no layer and are not plotted. Exact agreement (0) is drawn at FLOOR so
that it shows on the log scale.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from megalign.compare.records import Report  # noqa: E402
from megalign.dump.format import Kind  # noqa: E402

SERIES = ((Kind.ACTIVATION, "activations"), (Kind.ACTIVATION_GRAD, "activation grads"),
          (Kind.PARAM_GRAD, "param grads"))
FLOOR = 1e-20


def plot_divergence(report: Report, path: Path) -> None:
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for kind, label in SERIES:
        worst: dict[int, float] = {}
        for row in report.rows:
            if row.kind == kind and row.layer is not None and row.metrics is not None:
                worst[row.layer] = max(worst.get(row.layer, 0.0), row.metrics.rel_diff)
        if worst:
            layers = sorted(worst)
            axes.plot(layers, [max(worst[layer], FLOOR) for layer in layers], marker="o", label=label)
    axes.set_yscale("log")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("layer")
    axes.set_ylabel("relative difference (max over the layer's tensors)")
    axes.set_title(f"{report.a.path.name} vs {report.b.path.name}")
    axes.grid(True, which="both", alpha=0.3)
    if axes.lines:
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
