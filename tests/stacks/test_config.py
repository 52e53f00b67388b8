"""Model configs: the YAML files load, the tiny one is the embedded default, typos are refused."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from megalign.errors import UserError
from megalign.spec import ModelConfig
from megalign.stacks.megatron.cpu_patches import PATCHES

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_tiny_yaml_is_the_embedded_default():
    assert ModelConfig.from_yaml(CONFIGS / "tiny.yaml") == ModelConfig()


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    assert ModelConfig.from_yaml(path).name == path.stem


def test_unknown_key_is_named():
    with pytest.raises(UserError, match="unknown config key.*num_layer\\b"):
        ModelConfig.from_dict({"num_layer": 2})


def test_a_yaml_merge_key_may_be_overridden_but_a_key_given_twice_is_refused(tmp_path):
    """`<<: *base` then a key of the mapping's own is YAML's override, not a duplicate (refused once by
    mistake); the same key written twice is."""
    merged = tmp_path / "merged.yaml"
    merged.write_text("sizes: &sizes {hidden_size: 64, ffn_hidden_size: 128}\n"
                      "model:\n  <<: *sizes\n  hidden_size: 32\n")
    import yaml

    from megalign.spec import _UniqueKeyLoader

    assert yaml.load(merged.read_text(), Loader=_UniqueKeyLoader)["model"] == {"hidden_size": 32, "ffn_hidden_size": 128}
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key 'hidden_size'"):
        yaml.load("hidden_size: 64\nhidden_size: 32\n", Loader=_UniqueKeyLoader)


def test_every_cpu_patch_target_still_exists_in_megatron_core():
    """Fails loudly when a megatron-core upgrade moves what a CPU patch replaces."""
    for patch in PATCHES:
        patch.check()
    assert len(PATCHES) >= 6


def test_the_start_up_patch_target_still_exists_in_megatron_core():
    """stacks/megatron/imports.py defers torch.compile while megatron-core is imported, because
    megatron.core.jit makes its jit_fuser torch.compile at import; were that gone, the patch would be
    dead code."""
    from megalign.stacks.megatron.cpu_patches import install_import_stubs

    install_import_stubs()
    import megatron.core.jit as jit

    assert "jit_fuser = torch.compile" in inspect.getsource(jit.enable_jit_fuser)


@pytest.mark.parametrize("changes, message", [
    ({"activation": "gelu"}, "activation must be silu or quick_gelu"),
    ({"activation_func_clamp_value": 7.0}, "activation_func_clamp_value needs activation quick_gelu"),
    ({"softmax_type": "off-by-one"}, "softmax_type must be vanilla or learnable"),
    ({"window_size": [7]}, "window_size must be [left, right]"),
    ({"window_size": [7, 0], "window_attn_skip_freq": [1]}, "window_attn_skip_freq must list 1 (windowed) or 0"),
    ({"position_embedding": "yarn", "yarn_mscale": 0.0}, "yarn_mscale must be a finite number > 0"),
])
def test_a_variant_setting_out_of_range_is_named(changes, message):
    """GPT-OSS's attention and MLP variants and YaRN, as a config file gives them."""
    with pytest.raises(UserError, match=re.escape(message)):
        ModelConfig.from_dict(changes)
