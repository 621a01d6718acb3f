"""scripts/synthetic_gguf.py's shapes: the configs it would build (no network, no llama.cpp)
have the real models' shapes and parameter counts."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "synthetic_gguf.py"
_spec = importlib.util.spec_from_file_location("synthetic_gguf_script", SCRIPT)
assert _spec is not None and _spec.loader is not None
synthetic = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = synthetic  # its dataclasses look their module up there
_spec.loader.exec_module(synthetic)

# name: (model_type, hidden, layers, heads, KV heads, MLP, vocabulary, size class)
EXPECTED = {
    "qwen2-0.5b": ("qwen2", 896, 24, 14, 2, 4864, 151_936, 0.5e9),
    "qwen2-1.5b": ("qwen2", 1536, 28, 12, 2, 8960, 151_936, 1.5e9),
    "qwen2-3b": ("qwen2", 2048, 36, 16, 2, 11008, 151_936, 3e9),
    "llama-0.5b": ("llama", 1024, 24, 16, 8, 4096, 128_256, 0.5e9),
    "llama-1b": ("llama", 2048, 16, 32, 8, 8192, 128_256, 1.24e9),  # Llama 3.2 1B's own
    "llama-3b": ("llama", 3072, 28, 24, 8, 8192, 128_256, 3e9),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_config_has_the_shape_and_size(name: str) -> None:
    model_type, hidden, layers, heads, kv, mlp, vocab, size = EXPECTED[name]
    shape = synthetic.SHAPES[name]
    config = synthetic.build_config(shape)
    assert config.model_type == model_type
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (
        hidden, layers, heads, kv, mlp, vocab)
    assert config.tie_word_embeddings
    count = synthetic.parameter_count(config)
    assert abs(count - size) / size < 0.15
    assert abs(count - shape.nominal) / shape.nominal < 0.02  # the real model's published count


@pytest.mark.parametrize("name", ["qwen2-0.5b", "llama-0.5b"])
def test_parameter_count_is_the_models_own(name: str) -> None:
    """The counted parameters equal those of the transformers model built on the meta device
    (no memory, no random numbers)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = synthetic.build_config(synthetic.SHAPES[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert synthetic.parameter_count(config) == sum(p.numel() for p in model.parameters())


def test_tokenizer_must_fit_the_vocabulary() -> None:
    with pytest.raises(synthetic.Failed, match="smaller than the tokenizer"):
        synthetic.build_config(synthetic.SHAPES["qwen2-0.5b"], tokenizer_size=200_000)


def test_outputs_are_named_per_shape_and_dead_runs_temps_removed(tmp_path: Path) -> None:
    shape = synthetic.SHAPES["llama-1b"]
    assert synthetic.out_path(shape, tmp_path) == tmp_path / "llama-1b-Q4_K_M.gguf"
    dead = tmp_path / f".tmp-{2**22 + 7}-llama-1b-x"  # a pid above the kernel's limit
    live = tmp_path / f".tmp-{os.getpid()}-llama-1b-y"
    dead.mkdir()
    live.mkdir()
    synthetic._remove_dead_temps(tmp_path, ".tmp-")
    assert not dead.exists() and live.exists()


def test_list_needs_nothing_built(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert synthetic.main(["--list", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "qwen2-0.5b" in out and "0.49 B parameters (not made)" in out
    assert len(out.splitlines()) == len(synthetic.SHAPES)
