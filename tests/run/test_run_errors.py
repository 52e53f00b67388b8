"""Bad input and failing workers: a one-line error, a non-zero exit, and nothing left on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import error_line, invoke


@pytest.fixture
def bad_files(tmp_path):
    full = "num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 128\nvocab_size: 128\n"
    (tmp_path / "typo.yaml").write_text("num_layers: 2\nhiden_size: 64\n")
    (tmp_path / "heads.yaml").write_text(full.replace("num_attention_heads: 4", "num_attention_heads: 3")
                                         .replace("hidden_size: 64", "hidden_size: 48"))
    (tmp_path / "big.json").write_text(json.dumps([[1, 2, 3, 999]]))
    (tmp_path / "broken.json").write_text("[[1, 2,")
    (tmp_path / "latin1.json").write_bytes(b"[[1, 2]] \xe9")
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "single.json").write_text("[[5], [7]]")
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "taken.partial").write_text("a file of the user's")
    (tmp_path / "syntax.yaml").write_text("name: x\nnum_layers: [2\n")
    (tmp_path / "sparse.yaml").write_text("name: mine\nnum_layers: 4\n")
    (tmp_path / "eps.yaml").write_text(full + "layernorm_epsilon: -1\n")
    (tmp_path / "std.yaml").write_text(full + "init_method_std: .nan\n")
    (tmp_path / "twice.yaml").write_text(full + "hidden_size: 128\n")
    with open(tmp_path / "huge.json", "wb") as huge:  # sparse: no disk spent
        huge.truncate((64 << 20) + 1)
    return tmp_path


@pytest.mark.parametrize("args, message", [
    (["--config", "{d}/typo.yaml"], "unknown config key(s) hiden_size"),
    (["--config", "{d}/missing.yaml"], "config not found"),
    (["--config", "{d}/heads.yaml", "--tp", "2"], "--tp 2 does not divide num_attention_heads=3"),
    (["--cp", "3"], "not divisible by 2*cp=6"),
    (["--tokens", "{d}/big.json"], "token id 999 outside the vocabulary [0, 128)"),
    (["--tokens", "{d}/broken.json"], "is not valid JSON"),
    (["--seq-len", "16"], "shorter than the longest sequence"),
    (["--attention", "local", "--cp", "2"], "cannot run with --cp > 1"),
    (["--filter", "("], "not a valid regular expression"),
    (["--device", "cuda"], "no CUDA device is available"),
    (["--config", "{d}/folder"], "is a folder"),
    (["--tokens", "{d}/folder"], "is a folder"),
    (["--tokens", "{d}/latin1.json"], "unreadable (UnicodeDecodeError"),
    (["--config", "{d}/latin1.yaml"], "unreadable (UnicodeDecodeError"),
    (["--tokens", "{d}/deep.json"], "nested too deeply"),
    (["--tokens", "{d}/single.json"], "no sequence has two tokens"),
    (["--config", "{d}/syntax.yaml"], "syntax.yaml:3:1: not valid YAML"),
    (["--config", "{d}/sparse.yaml"], "missing hidden_size, num_attention_heads, ffn_hidden_size, vocab_size"),
    (["--config", "{d}/eps.yaml"], "layernorm_epsilon must be a finite number > 0, got -1"),
    (["--config", "{d}/std.yaml"], "init_method_std must be a finite number > 0, got nan"),
    (["--nnodes", "0"], "--nnodes must be at least 1"),
    (["--tp", "0"], "--tp must be at least 1, got 0"),
    (["--dp", "0"], "--dp must be at least 1, got 0"),
    (["--ep", "0"], "--ep must be at least 1, got 0"),
    (["--timeout", "nan"], "--timeout must be a positive number of seconds, got nan"),
    (["--timeout", "inf"], "--timeout must be a positive number of seconds, got inf"),
    (["--timeout", "-1"], "--timeout must be a positive number of seconds, got -1"),
    (["--tokens", "/dev/zero"], "tokens file /dev/zero is not a regular file"),
    (["--config", "/dev/zero"], "config /dev/zero is not a regular file"),
    (["--tokens", "{d}/huge.json"], "is larger than 64 MiB"),
    (["--config", "{d}/twice.yaml"], "twice.yaml:6:1: not valid YAML (duplicate key 'hidden_size')"),
    (["--dtype", "fp64", "--attention", "te"], "TransformerEngine's attention has no float64 kernels"),
    (["--sp"], "--sp splits the sequence over the TP ranks: it needs --tp > 1"),
    (["--dp", "3"], "--dp 3 does not divide the 2 sequences"),
    (["--tp", "2", "--sp", "--seq-len", "33"], "not divisible by cp*tp=2"),
    (["--grad-source", "shard"], "it needs --distributed-optimizer"),
    (["--nnodes", "1", "--node-rank", "3"], "--node-rank 3 is not in [0, --nnodes 1)"),
    (["--packed", "--cp", "2", "--seq-len", "48"], "take 52 tokens once each is padded to a multiple of 4; "
                                                   "--seq-len 48 does not hold them"),
    (["--packed", "--cp", "2", "--seq-len", "58"], "--seq-len 58 is not a multiple of 4"),
    (["--packed", "--dp", "3"], "--dp 3 does not divide the 2 sequences"),
    (["--packed", "--attention", "local"], "does not take packed sequences"),
    (["--packed", "--stack", "hf", "--hf", "{d}/folder"], "--stack hf runs padded batches only"),
    # GLM-4.5's shape (qk_layernorm): megatron-core's local spec asserted in every rank's model build
    (["--config", str(Path(__file__).parents[2] / "configs" / "tiny-glm-moe.yaml"), "--tp", "2", "--sp"],
     "--sp with the model's q/k norms (qk_layernorm)"),
])
def test_bad_input_is_one_line_and_exit_2(bad_files, tmp_path, args, message):
    out = tmp_path / "out"
    result = invoke("backward", *[a.format(d=bad_files) for a in args], "--out", out)
    assert result.exit_code == 2, result.output
    assert message in error_line(result)
    assert not out.exists()


@pytest.mark.parametrize("out, message", [
    ("/proc/megalign-test", "cannot create /proc/megalign-test.partial"),
    ("{d}/afile/sub", "afile is not a folder"),
    (".", "is the working folder"),
    ("{d}/taken", "taken.partial exists and is not a folder"),
])
def test_bad_out_is_one_line_and_exit_2(bad_files, out, message):
    result = invoke("forward", "--out", out.format(d=bad_files))
    assert result.exit_code == 2, result.output
    assert message in error_line(result)


def test_distributed_optimizer_needs_backward(tmp_path):
    result = invoke("forward", "--dp", "2", "--distributed-optimizer", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "it needs backward" in error_line(result)


def test_non_empty_out_is_refused_without_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = invoke("forward", "--out", out)
    assert result.exit_code == 2
    assert "--overwrite" in error_line(result)
    assert (out / "keep.txt").read_text() == "mine"


def test_crashing_worker_names_its_rank_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGALIGN_FAULT", "crash@1")
    out = tmp_path / "out"
    result = invoke("backward", "--cp", "2", "--out", out)
    assert result.exit_code == 1
    assert "rank 1 failed: RuntimeError: fault injected" in error_line(result, traceback=True)
    assert "in _inject_fault" in result.output
    assert list(tmp_path.iterdir()) == []  # neither out nor out.partial


def processes_with_env(entry: str) -> list[int]:
    """Live processes whose environment holds `entry`: this test's workers, and no one else's."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if entry.encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def test_hanging_worker_is_stopped_at_the_timeout(tmp_path):
    """In a megalign process of its own, as a user runs it: every process it started carries the
    marker (its launcher server too, forked.py: a forked process keeps its server's environment)."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, MEGALIGN_TEST_RUN=marker, MEGALIGN_FAULT="hang@1")
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "megalign", "forward", "--cp", "2", "--timeout", "10", "--out",
                             str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "timed out after 10 s" in result.stderr.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []
    assert not processes_with_env(f"MEGALIGN_TEST_RUN={marker}"), "workers left running after a timeout"


def test_gradients_read_from_grad_under_ddp_fail_loudly(tmp_path):
    """The classic empty gradient dump: under DDP `.grad` is None and the gradient is in main_grad."""
    out = tmp_path / "out"
    result = invoke("backward", "--grad-source", "grad", "--out", out)
    assert result.exit_code == 1
    line = error_line(result)
    assert "15 of 15 parameters have no gradient (read from grad)" in line
    assert "embedding.word_embeddings.weight" in line
    assert not out.exists()


def test_the_timeout_holds_while_the_launcher_server_imports(tmp_path):
    """run/forked.py's server imports megatron-core before it forks a launcher: an import that hangs there
    (here a package megatron-core tries, apex) is stopped at --timeout like a hanging rank."""
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("import time\ntime.sleep(1000)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(Path(__file__).parents[2])]))
    result = subprocess.run([sys.executable, "-m", "megalign", "forward", "--timeout", "5", "--out",
                             str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "timed out after 5 s (--timeout) while megalign's launcher server imported" in result.stderr
    assert not (tmp_path / "out").exists()


def test_an_environment_larger_than_a_socket_message_runs(tmp_path, monkeypatch):
    """The launcher server gets each run's environment through a pipe: 240 KB (module systems, exported
    shell functions) is more than one message of its socket holds."""
    for name, fill in (("MEGALIGN_TEST_BIG1", "x"), ("MEGALIGN_TEST_BIG2", "y")):
        monkeypatch.setenv(name, fill * 120_000)
    result = invoke("forward", "--cp", "2", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
