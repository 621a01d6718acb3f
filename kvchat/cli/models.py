"""`kvchat models`: which model would load, from where, and what its KV cache costs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.cli.app import app, stdout
from kvchat.cli.options import (
    BlockSizeOption,
    CacheMbOption,
    DeviceOption,
    DtypeOption,
    ModelOption,
)

if TYPE_CHECKING:
    from kvchat.models.footprint import Available, Footprint

from rich import box
from rich.table import Table

from kvchat.config import CacheConfig
from kvchat.models.footprint import IGNORE_ENV_VAR, available_memory, footprint_of, gguf_head
from kvchat.models.loading import ModelReport, describe_model


@app.command()
def models(
    model: ModelOption = None,
    dtype: DtypeOption = None,
    device: DeviceOption = "auto",
    block_size: BlockSizeOption = 16,
    cache_mb: CacheMbOption = 1024.0,
) -> None:
    """Show which model would load, from where, at which precision, what one decode step reads,
    what its KV cache costs per token and the memory it will hold against what this machine
    has."""
    cache = CacheConfig(block_size=block_size, cache_mb=cache_mb)
    report = describe_model(model, dtype=dtype, device=device)
    per_token = report.facts.kv_bytes_per_token(report.dtype)
    footprint = footprint_of(report.source, report.folder, report.precision.name,
                             report.tied_head, per_token, cache, packed=report.packed_ready)
    head = int4 = None
    if report.precision.quantized:
        from kvchat.models.native import int4_kernel_name, kernel_name

        form = gguf_head(Path(report.source.location), report.tied_head) \
            if report.source.is_gguf else "int8, a float32 scale per 32 weights"
        head = f"{form}, {kernel_name()}"
        int4 = int4_kernel_name() if report.precision.name == "int4" else None
        if report.device != "cpu":  # gpu_weights.place_on_gpu
            head = f"{form}, logits from a bfloat16 copy on {report.device}"
            int4 = f"torch's int4 kernel on {report.device}"
    from kvchat.engine.forward_plan import choose_forward

    facts = report.facts
    forward = choose_forward(facts.architecture, report.precision.name,
                             report.precision.compute_dtype, report.device,
                             sliding=facts.sliding_window is not None).describe()
    stdout().print(model_table(report, footprint, available_memory(), head, int4, forward))


def model_table(report: ModelReport, footprint: Footprint | None = None,
                available: Available | None = None, head_kernel: str | None = None,
                int4_kernel: str | None = None, forward: str | None = None) -> Table:
    """The `kvchat models` table: a pure function of the report and the memory estimate."""
    facts = report.facts
    table = Table(title=report.source.description, box=box.SIMPLE_HEAD, show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("Source", report.source.kind)
    if report.source.is_gguf:
        table.add_row("GGUF file", f"{report.source.location} ({_size(report.gguf_bytes)})")
        table.add_row("Converted folder", f"{report.folder} ({_size(report.folder_bytes)})")
        if report.packed_weights is not None:
            table.add_row("Packed weights", report.packed_weights)
    elif report.folder is not None:
        table.add_row("Folder", f"{report.folder} ({_size(report.folder_bytes)})")
    else:
        table.add_row("Hub id", report.source.location)
    table.add_row("Architecture", f"{facts.architecture} ({facts.model_type})")
    n = facts.n_params
    table.add_row("Parameters", "unknown" if n is None else f"{n:,} ({_count(n)})")
    table.add_row("Layers", str(facts.n_layers))
    table.add_row("Attention heads", str(facts.n_heads))
    table.add_row("KV heads", str(facts.n_kv_heads))
    table.add_row("Head dim", str(facts.head_dim))
    context = "unknown" if facts.max_context is None else f"{facts.max_context:,} tokens"
    table.add_row("Max context", context)
    table.add_row("Sliding window", _window(facts.sliding_window, facts.sliding_layers,
                                            facts.n_layers))
    table.add_row("Chat template", _template(report.chat_template))
    table.add_row("Vocab size", f"{facts.vocab_size:,}")
    precision = report.precision
    runs = precision.name + (f" weights, {precision.compute_dtype} compute"
                             if precision.quantized else "")
    table.add_row("Precision", f"{runs} on {report.device} ({precision.why})")
    if int4_kernel is not None:
        table.add_row("Int4 layers", f"{_int4_grid(int4_kernel)}, {int4_kernel}")
    if forward is not None:
        table.add_row("Forward", forward)
    if head_kernel is not None:
        table.add_row("Output head", head_kernel)
    step = report.step_bytes
    table.add_row("Weights read per decode step",
                  "unknown" if step is None else f"≈ {_size(step)}")
    per_token = facts.kv_bytes_per_token(report.dtype)
    table.add_row("KV bytes per token", f"{per_token:,}")
    # 1k tokens of B bytes each take B KB.
    table.add_row("KV per 1k tokens", f"{per_token:,} KB ({per_token * 1000 / 2**20:,.1f} MiB)")
    table.add_row("Resident after load", _resident(footprint))
    table.add_row("Memory available", _available(footprint, available, report.device))
    return table


def _resident(footprint: Footprint | None) -> str:
    if footprint is None:
        return "unknown (a hub model: its files are not read before loading)"
    return (f"~{_size(footprint.resident)} (weights {_size(footprint.weights)}, K/V pool "
            f"{_size(footprint.kv_pool)} when full, runtime {_size(footprint.runtime)}); "
            f"up to ~{_size(footprint.while_loading)} while loading "
            + (f"({_size(footprint.loading)} of float32 copies)" if footprint.loading else
               "(packed weights read as they are, no float32 copies)"))


def _available(footprint: Footprint | None, available: Available | None, device: str) -> str:
    if available is None:
        return "unknown (no /proc/meminfo here): loading is not checked"
    text = f"{_size(available.bytes)} ({available.where})"
    if footprint is None or device != "cpu":
        return text
    if footprint.total <= available.bytes:
        return f"{text}: fits (at most ~{_size(footprint.total)} at once)"
    return (f"{text}: does not fit (~{_size(footprint.total)} at once), so loading is refused "
            f"unless {IGNORE_ENV_VAR}=1")


def _int4_grid(kernel: str) -> str:
    """How the int4 layers hold a group's scale and zero on `kernel` (`int4_kernel_name`)."""
    if kernel.startswith("native"):
        return "a float16 scale and zero per 32 weights (a Q4_1 file's own)"
    return "a bfloat16 scale and zero per 32 weights"


def _window(window: int | None, sliding: int | None, n_layers: int) -> str:
    if window is None:
        return "none (every layer attends to the whole context)"
    if sliding is None:
        return f"{window:,} tokens (every layer)"
    return f"{window:,} tokens on {sliding} of {n_layers} layers (the others see everything)"


def _template(present: bool | None) -> str:
    if present is None:
        return "not checked (a hub model: its files are not read here)"
    if present:
        return "yes: chat and batch write conversations with it"
    return "none: plain text (a prompt as it is; conversations as 'User:' / 'Assistant:' " \
           "paragraphs); --chat-template sets one"


def _size(n_bytes: int | None) -> str:
    if n_bytes is None:
        return "size unknown"
    if n_bytes < 1024:
        return f"{n_bytes} B"
    size, unit = float(n_bytes) / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:,.1f} {unit}"


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)
