"""Plain .safetensors / .pt tensors against a megalign dump, and the weights_only guarantee."""

from __future__ import annotations

import pickle

import pytest
import torch
from compare_fixtures import CP1, CP2
from conftest import invoke
from safetensors.torch import save_file

from megalign.compare.sources import open_source


def export(path, names, perturb=None):
    """Write some activations of a dump as plain files: half safetensors, half .pt."""
    by_name = {e.name: e for e in open_source(path).entries if e.kind == "activation"}
    tensors = {name: by_name[name].load().tensor.clone() for name in names}
    if perturb:
        tensors[perturb].view(-1)[0] += 1.0
    return tensors


def test_plain_folder_vs_megalign_dump(dump, tmp_path):
    names = ["decoder.layers.0", "decoder.layers.1", "decoder.final_layernorm"]
    for folder, bad in (("good", None), ("bad", "decoder.layers.1")):
        tensors = export(dump(*CP1), names, perturb=bad)
        (tmp_path / folder).mkdir()
        save_file({k: tensors[k] for k in names[:2]}, str(tmp_path / folder / "layers.safetensors"))
        torch.save(tensors[names[2]], tmp_path / folder / f"{names[2]}.pt")
    # The files hold 3 of the dump's tensors: the others are missing on their side, on purpose.
    good = invoke("compare", tmp_path / "good", dump(*CP2), "--filter", "^decoder", "--allow-missing", ".")
    assert good.exit_code == 0, good.output
    assert "3 compared, 3 passed" in good.output
    assert invoke("compare", tmp_path / "good", dump(*CP2), "--filter", "^decoder").exit_code == 1  # unless allowed
    bad = invoke("compare", tmp_path / "bad", dump(*CP2), "--allow-missing", ".")
    assert bad.exit_code == 1 and "first divergence: activation decoder.layers.1" in bad.output


class Payload:
    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').write('x')",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickles_are_never_unpickled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps(Payload()))
    torch.save({"x": torch.ones(2)}, tmp_path / "fine.pt")
    result = invoke("compare", evil, tmp_path / "fine.pt")
    assert result.exit_code == 2 and "weights_only" in result.output
    assert not (tmp_path / "PWNED").exists()
