"""`--launcher none`: the user's own torchrun starts the ranks; megalign runs inside each one."""

from __future__ import annotations

import subprocess
import sys

from conftest import max_abs_diffs


def test_user_torchrun_with_launcher_none_matches_megalign_launch(dump, tmp_path):
    out = tmp_path / "own"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    "-m", "megalign", "forward", "--cp", "2", "--launcher", "none", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    assert (out / "dump.json").is_file()
    diffs = max_abs_diffs(dump("forward", "--cp", "1"), out)
    assert diffs and max(diffs.values()) < 1e-5
