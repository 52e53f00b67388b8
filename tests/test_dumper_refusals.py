"""What megalign.Dumper refuses at once, so that nothing is lost later and nothing unreadable is
written: a tensor no dump can hold (at add(), the rest of the dump landing), a forked child's use of
its parent's Dumper.

Written as a user writes a script: megalign.Dumper's public API, each dump read back and compared
with the real CLI.
"""

from __future__ import annotations

import pytest
import torch

import megalign
from tests.conftest import invoke

STORED = ("dense tensors of float64, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int64, int32, int16, "
          "int8, uint8, bool, with values")
# Each tensor a dump cannot hold, and what the refusal calls it.
UNSTORABLE = {
    "complex64": (lambda: torch.ones(2, dtype=torch.complex64), "a complex64 tensor"),
    "uint16": (lambda: torch.ones(2, dtype=torch.uint16), "a uint16 tensor"),
    "uint32": (lambda: torch.ones(2, dtype=torch.uint32), "a uint32 tensor"),
    "qint8": (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "a qint8 tensor"),
    "fnuz": (lambda: torch.ones(2).to(torch.float8_e4m3fnuz), "a float8_e4m3fnuz tensor"),
    "meta": (lambda: torch.ones(2, device="meta"), "a tensor on the meta device"),
    "sparse": (lambda: torch.eye(2).to_sparse(), "a tensor of layout torch.sparse_coo"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
               "a nested tensor"),
}


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")  # deprecated; users still have qint8 tensors
@pytest.mark.parametrize("stats_only", [False, True])
def test_a_tensor_no_dump_can_hold_is_refused_at_add_and_the_rest_lands(tmp_path, stats_only):
    """complex64, uint32, ... were taken, and close() lost the whole dump (stats-only: wrote one that
    nothing could read); sparse and nested tensors met torch's internal errors. Each is refused with one
    line, and the dump lands with the rest: float8 too, values or statistics, judged both ways."""
    h = torch.linspace(-1, 1, 8)
    for run, scale in (("a", 1.0), ("b", 2.0)):
        with megalign.Dumper(tmp_path / run, stats_only=stats_only) as dumper:
            dumper.add("activation", "h", h)
            for name, (make, said) in UNSTORABLE.items():
                with pytest.raises(TypeError) as refused:
                    dumper.add("activation", name, make())
                assert str(refused.value) == f"activation {name}: megalign stores {STORED}; got {said}"
            dumper.add("activation", "h8", (h * scale).to(torch.float8_e4m3fn))
    assert megalign.open(tmp_path / "a").names() == [("activation", "h"), ("activation", "h8")]
    result = invoke("compare", tmp_path / "a", tmp_path / "a")
    assert result.exit_code == 0, result.output
    result = invoke("compare", tmp_path / "a", tmp_path / "b")  # the planted bug: h8 doubled
    assert result.exit_code == 1, result.output
    assert "first divergence: activation h8\n" in result.output
