"""The memory estimate before a load: the weights it predicts are the bytes the loaded model
holds, a model that will not fit is refused with one paragraph, and `kvchat models` shows both."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import build_tiny_config, build_tiny_model, write_tiny_gguf
from typer.testing import CliRunner

from kvchat import cli
from kvchat.cli import models as cli_models
from kvchat.config import CacheConfig
from kvchat.errors import ModelTooLarge
from kvchat.models import footprint
from kvchat.models.footprint import IGNORE_ENV_VAR, Available, footprint_of
from kvchat.models.loading import load_model, resolve_model

WIDE = {"COLUMNS": "400"}
TINY_KV_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head dim 16, float32


def held_bytes(model) -> int:
    """What a loaded model's tensors hold: parameters (a tied one once) and buffers."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def estimate_for(spec: str, loaded, cache: CacheConfig | None = None):
    source = resolve_model(spec)
    tied = bool(loaded.model.config.tie_word_embeddings)
    per_token = loaded.facts.kv_bytes_per_token(loaded.precision.name)
    return footprint_of(source, loaded.folder, loaded.precision.name, tied, per_token, cache)


@pytest.mark.parametrize("precision", ["int4", "int8", "bfloat16", "float32"])
def test_a_gguf_estimate_is_the_bytes_its_loaded_tensors_hold(precision, tiny_tokenizer,
                                                               tmp_path):
    # 256 wide: every linear layer takes the int4 kernel, the 259-row head int8
    config = build_tiny_config(tiny_tokenizer, hidden_size=256, intermediate_size=256)
    path = write_tiny_gguf(build_tiny_model(config), tiny_tokenizer, tmp_path / "tiny.gguf")
    loaded = load_model(str(path), dtype=precision, device="cpu")
    estimate = estimate_for(str(path), loaded)
    assert estimate is not None
    held = held_bytes(loaded.model)
    # the rotary inv_freq buffer (32 float32s) is the model's, not the file's
    assert held - 256 <= estimate.weights <= held, (estimate.weights, held)
    largest = 259 * 256  # the embedding and the head, in float32
    assert estimate.loading == int(footprint.GGUF_LOAD_COPIES * 4 * largest)
    assert estimate.kv_pool == 0  # no cache asked for


@pytest.mark.parametrize(("precision", "tied"), [("int4", True), ("int8", False),
                                                 ("float32", True)])
def test_a_folder_estimate_is_the_bytes_its_loaded_tensors_hold(precision, tied,
                                                                tiny_tokenizer, tmp_path):
    config = build_tiny_config(tiny_tokenizer, hidden_size=256, intermediate_size=256)
    config.tie_word_embeddings = tied
    model = build_tiny_model(config)
    if tied:
        model.tie_weights()
    model.save_pretrained(tmp_path / "tiny")
    tiny_tokenizer.save_pretrained(tmp_path / "tiny")
    loaded = load_model(str(tmp_path / "tiny"), dtype=precision, device="cpu")
    estimate = estimate_for(str(tmp_path / "tiny"), loaded)
    assert estimate is not None
    held = held_bytes(loaded.model)
    assert held - 256 <= estimate.weights <= held, (estimate.weights, held)


def test_the_pool_counts_at_its_configured_size_and_the_load_copy_is_not_added_to_it(tiny_gguf):
    # the pool is made once the float32 copies are gone; the tokenizer is loaded before them
    loaded = load_model(str(tiny_gguf), device="cpu")
    cache = CacheConfig(block_size=16, cache_mb=1)
    estimate = estimate_for(str(tiny_gguf), loaded, cache)
    assert estimate is not None
    blocks = 2**20 // (TINY_KV_PER_TOKEN * 16)
    assert estimate.kv_pool == blocks * 16 * TINY_KV_PER_TOKEN
    assert estimate.resident == estimate.weights + estimate.kv_pool + estimate.runtime
    assert 0 < estimate.tokenizer < estimate.runtime
    assert estimate.while_loading == (estimate.weights + footprint.IMPORTS_BYTES
                                      + estimate.tokenizer + estimate.loading)
    assert estimate.total == max(estimate.resident, estimate.while_loading)


def small_machine(monkeypatch: pytest.MonkeyPatch, mib: int = 64) -> Available:
    available = Available(mib * 2**20, "a test's patch")
    monkeypatch.setattr(footprint, "available_memory", lambda: available)
    monkeypatch.setattr(cli_models, "available_memory", lambda: available)
    return available


def test_a_model_that_does_not_fit_is_refused_with_one_paragraph(tiny_gguf, monkeypatch):
    small_machine(monkeypatch)
    with pytest.raises(ModelTooLarge) as caught:
        load_model(str(tiny_gguf), dtype="float32", device="cpu",
                   cache=CacheConfig(block_size=16, cache_mb=256))
    text = str(caught.value)
    assert "\n" not in text
    need = re.search(r"would need about ([\d,]+) MiB of memory at float32", text)
    assert need, text
    # the runtime (a tiny tokenizer), 256 MiB of pool and under 2 MiB of weights
    floor = (footprint.RUNTIME_BYTES + footprint.TOKENIZER_BYTES) // 2**20 + 256
    assert floor <= int(need.group(1).replace(",", "")) <= floor + 3
    assert "K/V pool 256 MiB when full" in text
    assert "64 MiB available (a test's patch)" in text
    assert "--dtype int4" in text and "--cache-mb" in text
    assert f"{IGNORE_ENV_VAR}=1 to load it anyway" in text


def test_without_a_pool_the_paragraph_does_not_offer_cache_mb(tiny_gguf, monkeypatch):
    small_machine(monkeypatch)
    with pytest.raises(ModelTooLarge) as caught:
        load_model(str(tiny_gguf), dtype="int4", device="cpu")
    text = str(caught.value)
    assert "K/V pool" not in text and "--cache-mb" not in text
    assert "a smaller model or a smaller quantization" in text


def test_the_override_loads_it_anyway_and_enough_memory_needs_none(tiny_gguf, monkeypatch):
    small_machine(monkeypatch)
    monkeypatch.setenv(IGNORE_ENV_VAR, "1")
    assert load_model(str(tiny_gguf), device="cpu").precision.name == "float32"
    monkeypatch.delenv(IGNORE_ENV_VAR)
    small_machine(monkeypatch, mib=64 * 1024)
    assert load_model(str(tiny_gguf), device="cpu", cache=CacheConfig()).model is not None


def test_kvchat_batch_reports_the_refusal_without_a_traceback(tiny_gguf, monkeypatch,
                                                              tmp_path):
    small_machine(monkeypatch)
    requests = tmp_path / "one.jsonl"
    requests.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(cli.app, ["batch", str(requests), "--model", str(tiny_gguf),
                                          "--sessions-dir", str(tmp_path / "s")], env=WIDE)
    assert result.exit_code == 2, result.output
    assert "Error:" in result.output and "would need about" in result.output
    assert "Traceback" not in result.output


def row(output: str, label: str) -> str:
    match = re.search(rf"^\s*{re.escape(label)}\s{{2,}}(.+?)\s*$", output, re.MULTILINE)
    assert match, f"no row {label!r} in:\n{output}"
    return match.group(1)


def test_kvchat_models_shows_the_estimate_and_the_memory_available(tiny_gguf, monkeypatch):
    runner = CliRunner()
    result = runner.invoke(cli.app, ["models", "--model", str(tiny_gguf), "--device", "cpu",
                                     "--cache-mb", "128"], env=WIDE)
    assert result.exit_code == 0, result.output
    resident = row(result.output, "Resident after load")
    assert re.fullmatch(r"~[\d.,]+ MiB \(weights [\d.,]+ KiB, K/V pool 128\.0 MiB when full, "
                        r"runtime [\d.,]+ MiB\); up to ~[\d.,]+ MiB while loading "
                        r"\([\d.,]+ (KiB|MiB) of float32 copies\)", resident), resident
    assert re.fullmatch(r"[\d.,]+ GiB \(.+\): fits \(at most ~[\d.,]+ MiB at once\)",
                        row(result.output, "Memory available"))
    small_machine(monkeypatch)
    result = runner.invoke(cli.app, ["models", "--model", str(tiny_gguf), "--device", "cpu"],
                           env=WIDE)
    assert row(result.output, "Memory available").startswith(
        "64.0 MiB (a test's patch): does not fit")
    assert f"unless {IGNORE_ENV_VAR}=1" in result.output


def test_a_cgroup_limit_leaves_less_than_meminfo(tmp_path: Path):
    (tmp_path / "memory.max").write_text(f"{3 * 2**30}\n")
    (tmp_path / "memory.current").write_text(f"{2 * 2**30}\n")
    (tmp_path / "memory.stat").write_text(f"anon 1\ninactive_file {2**29}\n")
    left = footprint._cgroup_left(tmp_path, "memory.max", "memory.current", "memory.stat",
                                  "inactive_file")
    assert left == 3 * 2**30 - (2 * 2**30 - 2**29)  # reclaimable file pages are not held
    (tmp_path / "memory.max").write_text("max\n")
    assert footprint._cgroup_left(tmp_path, "memory.max", "memory.current", "memory.stat",
                                  "inactive_file") is None


@pytest.mark.parametrize(("quant", "tied", "precision"), [
    ("Q4_K_M", False, "int4"), ("Q6_K", True, "int4"), ("Q8_0", True, "int8"),
    ("Q4_K", True, "int8"), ("Q4_K_M", False, "bfloat16"), ("Q8_0", True, "float32")])
def test_a_gguf_step_is_counted_from_its_header_as_the_load_counts_it(
        quant, tied, precision, tiny_tokenizer, tmp_path, monkeypatch):
    """`kvchat models`' "Weights read per decode step" for a GGUF: the bytes the loaded model's
    step reads (`quant.step_bytes`), whichever form its head and embedding take: a Q6_K head's
    blocks, shared with a tied embedding or not, an int8 head a Q8_0 table is read from, or
    one beside the embedding's own blocks, and float heads."""
    from kvchat.models import gguf_weights
    from kvchat.models.footprint import gguf_step_bytes

    monkeypatch.setattr(gguf_weights, "CHUNK_ROWS_BYTES", 4096)  # tables read by rows
    monkeypatch.setattr(footprint, "CHUNK_ROWS_BYTES", 4096)
    config = build_tiny_config(tiny_tokenizer, hidden_size=256, intermediate_size=256,
                               num_hidden_layers=1, tie_word_embeddings=tied)
    six = {"Q4_K_M": lambda n: "Q6_K" if n == "output.weight" else "Q4_K"}
    path = write_tiny_gguf(build_tiny_model(config), tiny_tokenizer, tmp_path / "m.gguf",
                           six.get(quant, lambda n: quant))
    loaded = load_model(str(path), dtype=precision, device="cpu")
    assert gguf_step_bytes(path, precision, tied) == loaded.step_bytes
