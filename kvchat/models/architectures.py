"""Which model architectures kvchat can page, decided from the config alone (no weights loaded).

kvchat's pools hold, for every layer, one K and one V tensor per token, each (kv_heads, head_dim).
That is a model's whole attention state only when every layer is softmax attention (full,
sliding-window or chunked) whose K and V have one width. A cached prefix is then valid for any
continuation and can be cut at any token. Recurrent layers (Mamba, linear attention, gated
convolutions) instead fold all earlier tokens into one fixed-size state, and an encoder-decoder's
decoder depends on the whole encoded input: neither can be cut at a token boundary or shared by
prompts that diverge later, so such models are refused when their config is read.

The rules read transformers' own per-layer cache kinds where it provides them, the config's layer
lists and attributes, and a short list of recurrent model types as a backstop for configs that
name no layer kinds, so a new architecture is judged by what it declares. `sliding_window` reads
the window (and the layers that slide) for `kvchat models`.
"""

from __future__ import annotations

from typing import Any

from kvchat.errors import NotACausalLM, UnpageableArchitecture

# The causal LMs of the common decoder families, by class, with their family names: the ones
# whose layers kvchat's fused decode forward knows (kvchat.engine.fused_decode) and whose
# residual stream it holds in float32 under quantized weights (kvchat.models.residual).
DECODER_FAMILIES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# Layer kinds whose whole state is per-token K/V. "attention" is how Jamba's layers_block_type and
# RecurrentGemma's block_types name an ordinary attention layer.
PAGEABLE_LAYER_KINDS = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention"}
)
# Kinds that fold the past into a fixed-size recurrent or convolution state.
_RECURRENT_KINDS = frozenset(
    {"mamba", "mamba2", "linear_attention", "conv", "recurrent", "hybrid", "hybrid_sliding", "rwkv"}
)
# Kinds that keep no K/V of their own: layers reusing another layer's cache, or without attention.
_NO_KV_KINDS = frozenset({"dummy", "mlp", "moe", "reuse"})
# Config attributes that list a kind per layer, across transformers' model families.
_LAYER_KIND_ATTRIBUTES = ("layer_types", "layers_block_type", "block_types")
# Recurrent or hybrid families, for configs (and transformers versions) that list no layer kinds.
_RECURRENT_MODEL_TYPES = frozenset(
    {
        "mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma", "jamba", "zamba",
        "zamba2", "bamba", "falcon_h1", "lfm2", "lfm2_moe", "granitemoehybrid", "nemotron_h",
        "qwen3_next", "minimax", "kimi_linear",
    }
)
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_ADVICE = (
    "Use a decoder-only transformer whose layers are all full or sliding-window attention "
    "(SmolLM2, Llama, Qwen2/Qwen3, Mistral, Gemma 2/3, Phi-3, OLMo 2, Granite, Mixtral, GPT-2 "
    "and the like), or run this model with transformers' own generate()."
)


def check_pageable(config: Any, description: str) -> None:
    """Raise UnpageableArchitecture unless every layer's state is per-token K/V of one shape."""
    reason = _unpageable_reason(config)
    if reason is None:
        return
    model_type = str(_attr(config, "model_type") or "unknown")
    architectures = list(_attr(config, "architectures") or [])
    shown = architectures[0] if architectures else model_type
    raise UnpageableArchitecture(
        f"{description} is a {shown} model (model_type {model_type!r}), and kvchat cannot page "
        f"its cache: {reason}. kvchat keeps each layer's keys and values per token in shared "
        f"blocks, so that any prompt with a cached prefix reuses it. {_ADVICE}"
    )


def check_causal_lm(config: Any, description: str) -> None:
    """Raise NotACausalLM unless transformers can build a left-to-right LM for this config."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = str(getattr(config, "model_type", "") or "")
    architectures = list(getattr(config, "architectures", None) or [])
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    # A folder saved from, say, BertForMaskedLM has a causal class for its model type
    # (BertLMHeadModel), but its weights are not a left-to-right LM.
    architecture_ok = not architectures or any(
        name in causal_classes or name.endswith(_CAUSAL_SUFFIXES) for name in architectures
    )
    if (
        model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and architecture_ok
        and not getattr(config, "is_encoder_decoder", False)
    ):
        return
    shown = architectures[0] if architectures else model_type or "unknown"
    raise NotACausalLM(
        f"{description} is a {shown} model (model_type {model_type!r}), not a causal "
        "language model: transformers has no AutoModelForCausalLM class for it, and kvchat "
        "generates text left to right with a KV cache. Pick a decoder-only chat model such as "
        "SmolLM2, Llama, Qwen2 or Mistral."
    )


def kv_heads(config: Any) -> int:
    """K/V heads per layer in the model's cache: what the K/V pools must be sized with.

    Most configs say it in num_key_value_heads. Falcon and GPTBigCode say it with flags instead,
    and their caches do not hold num_attention_heads heads when multi_query is set.
    """
    text = decoder_config(config)
    heads = int(text.num_attention_heads)
    explicit = _attr(text, "num_key_value_heads")
    if explicit:
        return int(explicit)
    if _attr(text, "new_decoder_architecture"):
        # Falcon-40B's layout broadcasts its K/V groups to every query head before caching.
        return heads
    if _attr(text, "multi_query"):
        # One K/V head shared by all query heads (Falcon-7B, GPTBigCode).
        return 1
    return heads


def align_kv_heads(config: Any) -> None:
    """Record kv_heads() as num_key_value_heads where a config names its K/V heads otherwise.

    Code that sizes caches from the standard attribute (kvchat's pools, transformers' static
    caches) would otherwise allocate num_attention_heads heads for a multi-query Falcon.
    """
    text = decoder_config(config)
    if _attr(text, "num_key_value_heads") is None:
        n_kv = kv_heads(text)
        if n_kv != int(text.num_attention_heads):
            text.num_key_value_heads = n_kv


def decoder_config(config: Any) -> Any:
    """The config of the text decoder (a multimodal config nests it)."""
    getter = getattr(config, "get_text_config", None)
    try:
        return getter(decoder=True) if getter is not None else config
    except Exception:
        # Configs with no single decoder (or a broken one) are judged as they stand.
        return config


def layer_kinds(config: Any) -> frozenset[str]:
    """Every kind of layer the config declares, from transformers' cache layout and its lists."""
    text = decoder_config(config)
    kinds: set[str] = set()
    for name in _LAYER_KIND_ATTRIBUTES:
        value = _attr(text, name)
        if isinstance(value, (list, tuple)):
            kinds.update(str(kind).lower() for kind in value)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # older transformers: the config's own lists are all there is
        return frozenset(kinds)
    try:
        cache_kinds, _ = get_layer_types_and_kwargs(text)
    except Exception:
        # A config transformers cannot lay a cache out for is judged by its lists alone.
        return frozenset(kinds)
    return frozenset(kinds | {str(kind).lower() for kind in cache_kinds})


def _unpageable_reason(config: Any) -> str | None:
    if _attr(config, "is_encoder_decoder"):
        return (
            "it is an encoder-decoder model, whose decoder attends to the encoded input through "
            "cross-attention, so its cache depends on the whole input rather than on a prefix of "
            "tokens"
        )
    text = decoder_config(config)
    kinds = layer_kinds(config)
    recurrent = sorted(kinds & _RECURRENT_KINDS)
    if recurrent or str(_attr(text, "model_type") or "") in _RECURRENT_MODEL_TYPES:
        shown = f" ({', '.join(recurrent)})" if recurrent else ""
        return (
            f"its recurrent or hybrid layers{shown} fold every earlier token into a fixed-size "
            "state instead of keeping keys and values per token, so a cached prefix cannot be cut "
            "at a token boundary or shared by prompts that diverge later"
        )
    if kinds & _NO_KV_KINDS:
        return (
            "some of its layers keep no keys and values of their own (they reuse another layer's "
            "or have no attention), so its cache does not have one K/V pair per layer"
        )
    other = sorted(kinds - PAGEABLE_LAYER_KINDS)
    if other:
        return (
            f"its {', '.join(other)} layers keep more than per-token keys and values (such as "
            "sparse-attention indexers or compressed attention)"
        )
    return _latent_attention_reason(text)


def _latent_attention_reason(text: Any) -> str | None:
    # Multi-head latent attention (DeepSeek V2/V3 and kin) caches K wider than V.
    if _attr(text, "kv_lora_rank"):
        return (
            "it uses multi-head latent attention, whose keys and values have different widths, "
            "and kvchat's pools hold K and V of one shape"
        )
    v_width = _attr(text, "v_head_dim")
    heads = _attr(text, "num_attention_heads")
    k_width = _attr(text, "head_dim") or (
        _attr(text, "hidden_size") // heads if heads and _attr(text, "hidden_size") else None
    )
    if v_width and k_width and int(v_width) != int(k_width):
        return (
            f"its keys ({k_width} wide per head) and values ({v_width} wide) differ in width, and "
            "kvchat's pools hold K and V of one shape"
        )
    return None


def _attr(config: Any, name: str) -> Any:
    """getattr that treats an unreadable attribute as absent: heterogeneous configs raise on
    global access to a per-layer attribute."""
    try:
        return getattr(config, name, None)
    except Exception:
        return None


def sliding_window(text: Any) -> dict[str, int | None]:
    """The sliding window, and on how many layers when only some have one (Gemma 2 and 3
    alternate), from the config; none when the config turns it off (Qwen2's default)."""
    window = getattr(text, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(text, "use_sliding_window",
                                                             True) is False:
        return {}
    types = getattr(text, "layer_types", None)
    if isinstance(types, list) and types:
        sliding = sum(1 for t in types if t == "sliding_attention")
        if not sliding:
            return {}
        return {"sliding_window": window,
                "sliding_layers": None if sliding == len(types) else sliding}
    return {"sliding_window": window}
