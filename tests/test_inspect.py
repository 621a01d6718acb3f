"""`kvchat inspect`: the saved cache read from index.json alone (no model, no torch), its JSON
schema against the live cache that wrote it, the session filter, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvchat import cli
from kvchat.cache.kvcache import PagedKVCache
from kvchat.cache.stats import CacheStats
from kvchat.cli import inspect_cmd
from kvchat.config import CacheConfig
from kvchat.inspect import documents as cv
from kvchat.snapshots import save_snapshot

WIDE = {"COLUMNS": "200"}


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args), env=WIDE)


FINGERPRINT = {"model": "tiny", "config": "c0", "tokenizer": "t0", "dtype": "float32",
               "block_size": 4}


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tiny_tokenizer, tmp_path_factory) -> tuple[Path, PagedKVCache]:
    """A sessions dir whose snapshot holds two sessions that share the template's prefix: alpha
    (two turns, the second extending the first) and beta, with an exact entry per prompt. The
    cache is filled directly (no model), as a chat would leave it."""
    root = tmp_path_factory.mktemp("sessions")
    cache = PagedKVCache.create(CacheConfig(4, cache_mb=1), n_layers=1, n_kv_heads=1, head_dim=2)

    def chat(*texts: str) -> list[int]:
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                 for i, t in enumerate(texts)]
        text = tiny_tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                                  tokenize=False)
        return list(tiny_tokenizer.encode(text, add_special_tokens=False))

    def reply(text: str) -> list[int]:
        return list(tiny_tokenizer.encode(text + "<|im_end|>\n", add_special_tokens=False))

    turns = (("alpha", chat("hello"), "hi!"), ("alpha", chat("hello", "hi!", "more"), "ok"),
             ("beta", chat("something else"), "sure"))
    for sid, prompt, answer in turns:
        hit = cache.lookup(prompt, sid=sid)
        tokens = prompt + reply(answer)  # the next turn extends this history
        zeros = torch.zeros(1, 1, len(tokens) - hit.matched, 2)
        cache.write_kv(tokens, [(zeros, zeros)], hit.matched, logits=torch.zeros(8),
                    logits_len=len(prompt), sid=sid)
        cache.release(hit.blocks)
        cache.check_integrity()
    pool = cache.manager.stats()
    save_snapshot(root, cache, FINGERPRINT, {
        "tokenizer_file": str(tiny_model_dir / "tokenizer.json"),
        "model_label": "local folder tiny-model",
        "pool": {"total_blocks": pool.total_blocks, "bytes_per_block": pool.bytes_per_block},
    })
    return root, cache


def test_a_servers_exact_entries_show_their_lengths_and_previews(saved):
    """A server's /cache/tree gives each exact entry's length and preview, not its ids: the
    text view shows those, as it shows a saved snapshot's."""
    from rich.console import Console

    from kvchat.client.documents import exact_from_document
    from kvchat.ui.inspect_view import exact_table

    _, cache = saved
    entries = cv.exact_from_cache(cache)
    assert entries

    def decode(tokens):
        return " ".join(f"t{t}" for t in tokens)

    def shown(views) -> str:
        console = Console(width=200, record=True)
        console.print(exact_table(views, decode))
        return console.export_text()

    document = cv.exact_json(entries, decode)
    served = exact_from_document(document)
    assert [e.n_tokens for e in served] == [len(e.tokens) for e in entries]
    rows = [line.split() for line in shown(served).splitlines()[4:4 + len(entries)]]
    local = [line.split() for line in shown(entries).splitlines()[4:4 + len(entries)]]
    assert [r[:3] for r in rows] == [r[:3] for r in local]  # tokens, blocks, logits
    assert [" ".join(r[3:]) for r in rows] == [e["preview"] for e in reversed(document)]


def test_json_schema_matches_the_cache_that_was_saved(saved):
    root, cache = saved
    result = invoke("inspect", "--sessions-dir", str(root), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert set(doc) == {"fingerprint", "snapshot", "stats", "pool", "tree", "exact", "tiers"}
    assert doc["fingerprint"] == FINGERPRINT
    assert doc["snapshot"]["path"] == str(root / "cache" / "index.json")
    assert doc["snapshot"]["tokenizer_file"].endswith("tokenizer.json")

    decode = inspect_cmd._snapshot_decoder(doc["snapshot"]["tokenizer_file"])
    assert doc["tree"] == cv.tree_json(cv.nodes_from_cache(cache), decode)
    assert doc["exact"] == cv.exact_json(cv.exact_from_cache(cache), decode)
    stats = cache.stats()
    assert doc["stats"] == stats.to_json()  # the live cache's numbers, in /cache/stats' schema
    assert CacheStats.from_json(doc["stats"]) == stats
    assert doc["tiers"]["memory"]["blocks"] == stats.pool.used_blocks
    assert doc["tiers"]["disk"] == {"blocks": 0, "bytes": 0, "budget_bytes": 0, "tokens": 0,
                                    "path": str(root / "cache" / "store")}
    assert doc["stats"]["sessions"]["alpha"]["lookups"] == 2
    assert doc["pool"] == doc["stats"]["pool"] == {
        "block_size": 4, "total_blocks": stats.pool.total_blocks,
        "used_blocks": stats.pool.used_blocks, "free_blocks": stats.pool.free_blocks,
        "utilisation": stats.pool.utilisation, "bytes_per_block": stats.pool.bytes_per_block,
        "cached_tokens": stats.tree_tokens,
    }
    root_node = doc["tree"][0]
    assert root_node["owners"] == ["alpha", "beta"]
    assert root_node["preview"] == "<|im_start|…start|>user⏎"  # decoded, not ids
    assert {c["owners"][0] for c in root_node["children"]} == {"alpha", "beta"}
    assert all(key in root_node for key in ("start", "n_tokens", "n_blocks", "max_ref", "tokens",
                                            "children", "children_omitted"))


def test_session_filter_and_depth(saved):
    root, _ = saved
    doc = json.loads(invoke("inspect", "--sessions-dir", str(root), "--json", "--session",
                            "beta").output)
    nodes, stack = [], list(doc["tree"])
    while stack:
        nodes.append(stack.pop())
        stack.extend(nodes[-1]["children"])
    assert len(nodes) == 2 and all("beta" in n["owners"] for n in nodes)
    assert len(doc["tree"][0]["children"]) == 1
    assert doc["snapshot"]["session"] == "beta"
    assert len(doc["exact"]) == 1  # beta's one prompt; alpha's two are on the other branch
    shallow = json.loads(invoke("inspect", "--sessions-dir", str(root), "--json", "--depth",
                                "1").output)
    assert shallow["tree"][0]["children"] == []
    assert shallow["tree"][0]["children_omitted"] == 2


def test_text_view_shows_tree_pool_sessions_and_exact_index(saved):
    root, cache = saved
    result = invoke("inspect", "--sessions-dir", str(root))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "snapshot " + str(root / "cache" / "index.json") in out
    assert "local folder tiny-model" in out and "float32 · block 4 tok" in out
    stats = cache.stats()
    assert f"used {stats.pool.used_blocks} / {stats.pool.total_blocks:,} blocks" in out
    assert f"radix tree · 3 nodes · {stats.tree_tokens} tok" in out
    assert '"<|im_start|…' in out and " alpha, beta" in out
    assert "exact index · 3 entries" in out


def test_previews_fall_back_to_token_ids_without_a_tokenizer(saved, tmp_path):
    root, _ = saved
    copy = tmp_path / "copy"
    (copy / "cache").mkdir(parents=True)
    meta = json.loads((root / "cache" / "index.json").read_text())
    meta["tokenizer_file"] = str(tmp_path / "gone.json")
    (copy / "cache" / "index.json").write_text(json.dumps(meta))
    result = invoke("inspect", "--sessions-dir", str(copy))
    assert result.exit_code == 0, result.output
    assert "previews show token ids" in result.output
    assert '"1 85 ' in result.output  # <|im_start|> is id 1, then bytes


def test_inspect_imports_neither_torch_nor_transformers(saved):
    root, _ = saved
    code = (
        "import sys\n"
        f"sys.argv = ['kvchat', 'inspect', '--sessions-dir', {str(root)!r}]\n"
        "from kvchat import cli\n"
        "try:\n    cli.main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout


def test_no_snapshot_is_a_clear_message(tmp_path):
    result = invoke("inspect", "--sessions-dir", str(tmp_path))
    assert result.exit_code == 1
    assert f"No cache snapshot in {tmp_path / 'cache'}" in result.output


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"blocks": []}),  # no tree
        json.dumps({"tree": [{"start": 0, "blocks": [7], "children": []}], "blocks": [],
                    "kv_file": "kv.safetensors", "block_size": 4}),
    ],
    ids=["not-json", "no-tree", "dangling-block"],
)
def test_damaged_index_is_a_clear_error_and_is_left_alone(tmp_path, content):
    index = tmp_path / "cache" / "index.json"
    index.parent.mkdir()
    index.write_text(content)
    result = invoke("inspect", "--sessions-dir", str(tmp_path))
    assert result.exit_code == 2
    assert f"The cache snapshot {index} cannot be read" in result.output
    assert "Traceback" not in result.output
    assert index.read_text() == content  # inspect only reads
