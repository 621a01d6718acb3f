"""Architectures: cached == cold greedy output through `kvchat verify` on a tiny random model of
each decoder-only family kvchat supports, and a clear refusal, before any weights load, for those
whose cache it cannot page (recurrent and hybrid layers, encoder-decoders, latent attention)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_INIT_STD, TINY_SEED, build_tiny_tokenizer
from typer.testing import CliRunner

from kvchat import cli
from kvchat.errors import UnpageableArchitecture
from kvchat.models.architectures import check_pageable, kv_heads, layer_kinds
from kvchat.models.loading import describe_model, load_model

WIDE = {"COLUMNS": "200"}
PROMPT = "Name three colours of the sea."
# A window shorter than the ~50-token chat prompt, so the sliding-window layers do mask.
WINDOW = 24

# Per model_type: the config keys that differ from the shared ones below (2 layers, hidden 64,
# 4 heads, vocab 259). GPT-2, OPT and GPTBigCode name their sizes differently.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": 2},
    "qwen2": {"num_key_value_heads": 2},
    "qwen3": {"num_key_value_heads": 2, "head_dim": 16},
    "mistral": {"num_key_value_heads": 2, "sliding_window": WINDOW},
    "gemma2": {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": WINDOW,
               "query_pre_attn_scalar": 16},
    "gemma3_text": {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": WINDOW,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {"num_key_value_heads": 2},
    "olmo2": {"num_key_value_heads": 2},
    "granite": {"num_key_value_heads": 2},
    "mixtral": {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    # With the shared std, GPT-NeoX's parallel residual repeats one token; 0.5 varies.
    "gpt_neox": {"initializer_range": 0.5},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 2048, "n_inner": 128},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64, "init_std": TINY_INIT_STD},
    # Multi-query: one K/V head for all query heads, named by flags instead of num_key_value_heads.
    "falcon": {"multi_query": True, "new_decoder_architecture": False},
    "falcon-40b-layout": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "gpt_bigcode": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 2048,
                    "n_inner": 128, "multi_query": True},
}
_SHARED = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "max_position_embeddings": 2048,
    "initializer_range": TINY_INIT_STD, "tie_word_embeddings": False,
}
_NAMES_SIZES_THEMSELVES = {"gpt2", "gpt_bigcode"}


def build_model_dir(name: str, folder: Path) -> Path:
    """Save a seeded tiny random model of architecture `name`, with the tiny tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    model_type = "falcon" if name.startswith("falcon") else name
    shared = {} if model_type in _NAMES_SIZES_THEMSELVES else dict(_SHARED)
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **{**shared, **ARCHITECTURES[name]},
    )
    if model_type in _NAMES_SIZES_THEMSELVES:
        config.initializer_range = TINY_INIT_STD
    torch.manual_seed(TINY_SEED)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    # The equality below is only worth something if greedy output is not one repeated token.
    with torch.inference_mode():
        out = model.generate(torch.tensor([[1, 70, 80, 90]]), max_new_tokens=8, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    assert len(set(out[0, 4:].tolist())) > 1, f"{name}: greedy output does not vary"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def verify_rows(output: str) -> list[list[str]]:
    """Table rows: prompt, scenario, hit, equal, first diff, max |Δlogit| (split on 2+ spaces)."""
    rows = []
    for line in output.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 6 and cells[1] in ("prefix hit", "exact repeat", "in a batch",
                                                "plain generate"):
            rows.append(cells)
    return rows


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_cached_equals_cold(name: str, tmp_path: Path) -> None:
    folder = build_model_dir(name, tmp_path / name)
    result = CliRunner().invoke(
        cli.app,
        ["verify", PROMPT, "--model", str(folder), "--max-tokens", "8", "--device", "cpu",
         "--block-size", "4", "--cache-mb", "8"],
        env=WIDE,
    )
    assert result.exit_code == 0, result.output
    rows = verify_rows(result.output)
    assert rows, result.output
    assert all(row[3] == "yes" for row in rows), result.output
    # The prefix scenario must really read cached K/V for part of the prompt.
    hit, total = map(int, rows[0][2].split()[0].split("/"))
    assert 0 < hit < total, result.output
    assert len(rows) == 4
    assert f"All {len(rows)} runs match their reference run" in result.output
    if "bitwise" not in result.output:  # only a model kvchat cannot route through its kernel
        assert "token for token" in result.output


def test_multi_query_falcon_caches_one_kv_head(tmp_path: Path) -> None:
    loaded = load_model(str(build_model_dir("falcon", tmp_path / "falcon")), device="cpu")
    assert kv_heads(loaded.model.config) == 1
    assert loaded.model.config.num_key_value_heads == 1
    assert loaded.facts.n_kv_heads == 1
    # The 40B layout broadcasts its K/V groups to every query head before caching them.
    wide = load_model(str(build_model_dir("falcon-40b-layout", tmp_path / "f40")), device="cpu")
    assert kv_heads(wide.model.config) == wide.facts.n_kv_heads == 4


# --- refusals: a config.json alone, so these also show that no weights are needed --------------

REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "mamba": ({"hidden_size": 64, "num_hidden_layers": 2}, "recurrent or hybrid"),
    "jamba": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "attn_layer_period": 2, "attn_layer_offset": 1},
              "mamba"),
    "qwen3_next": ({"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                    "num_key_value_heads": 2}, "linear_attention"),
    "recurrent_gemma": ({"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4},
                        "recurrent"),
    "falcon_h1": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
                  "recurrent or hybrid"),
    "lfm2": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "layer_types": ["conv", "full_attention"]}, "conv"),
    "t5": ({"d_model": 64, "num_layers": 2, "num_heads": 4}, "encoder-decoder"),
    "bart": ({"d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
              "architectures": ["BartForConditionalGeneration"]}, "encoder-decoder"),
    "deepseek_v3": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
                    "latent attention"),
}


def save_config(model_type: str, fields: dict[str, Any], folder: Path) -> Path:
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **fields).save_pretrained(folder)
    assert not list(folder.glob("*.safetensors"))
    return folder


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_unpageable_architectures_are_refused_before_weights_load(
    model_type: str, tmp_path: Path
) -> None:
    fields, why = REFUSED[model_type]
    folder = save_config(model_type, fields, tmp_path / model_type)
    for read in (describe_model, load_model):
        with pytest.raises(UnpageableArchitecture) as info:
            read(str(folder), device="cpu")
        message = str(info.value)
        assert f"model_type {model_type!r}" in message
        assert why in message and "cannot page its cache" in message
        assert "Llama" in message and "\n" not in message


def test_refusal_through_the_cli_is_one_clean_paragraph(tmp_path: Path) -> None:
    folder = save_config("mamba", REFUSED["mamba"][0], tmp_path / "mamba")
    result = CliRunner().invoke(cli.app, ["verify", "hi", "--model", str(folder)], env=WIDE)
    assert result.exit_code == 2, result.output
    assert "cannot page its cache" in result.output and "Traceback" not in result.output


def test_layer_lists_decide_for_an_unknown_family() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    check_pageable(config, "a llama")
    # A new family is judged by the layers it declares, not by its name.
    config.layers_block_type = ["attention", "mamba"]
    assert "mamba" in layer_kinds(config)
    with pytest.raises(UnpageableArchitecture, match=r"\(mamba\)"):
        check_pageable(config, "a renamed hybrid")


def test_keys_and_values_of_different_widths_are_refused() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, head_dim=24)
    config.v_head_dim = 16
    with pytest.raises(UnpageableArchitecture, match="24 wide per head"):
        check_pageable(config, "a wide-key model")



def test_h2o_is_refused_where_attention_cannot_report_its_weights(tiny_tokenizer):
    from transformers import FalconConfig, FalconForCausalLM

    from kvchat.config import CacheConfig
    from kvchat.engine.attention import AttentionNotSwappable
    from kvchat.engine.engine import Engine

    config = FalconConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4)
    model = FalconForCausalLM(config).eval()
    with pytest.raises(AttentionNotSwappable, match="--policy lru"):
        Engine.create(model, tiny_tokenizer, CacheConfig(4, num_blocks=16, policy="h2o"))
    Engine.create(model, tiny_tokenizer, CacheConfig(4, num_blocks=16, policy="lru"))
