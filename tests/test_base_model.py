"""A model without a chat template (a base model) works everywhere: chat and batch send plain
text and say so once, verify checks it, serve answers /v1/completions and refuses chat
completions with a clear 400 unless --chat-template sets one; `kvchat models` tells it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from conftest import CHAT_TEMPLATE
from typer.testing import CliRunner

from kvchat.cli import app
from kvchat.config import CacheConfig
from kvchat.models.chat_template import TRANSCRIPT_STOPS, transcript
from kvchat.runtime import Runtime, RuntimeOptions
from kvchat.server import create_app, serving

runner = CliRunner()
WIDE = {"COLUMNS": "200"}
NOTICE = "has no chat template, so kvchat sends plain text"


def cache_args(root: Path) -> list[str]:
    return ["--sessions-dir", str(root), "--block-size", "4", "--cache-mb", "8"]


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_models_shows_the_missing_template_and_the_sliding_window(tiny_base_model_dir,
                                                                   tiny_model_dir):
    base = flat(runner.invoke(app, ["models", "--model", str(tiny_base_model_dir)],
                              env=WIDE).output)
    assert "Chat template none: plain text" in base
    assert "Sliding window none (every layer attends to the whole context)" in base
    chat = flat(runner.invoke(app, ["models", "--model", str(tiny_model_dir)], env=WIDE).output)
    assert "Chat template yes: chat and batch write conversations with it" in chat


def test_chat_with_a_base_model_continues_its_plain_text_history(tiny_base_model_dir, tmp_path):
    root = tmp_path / "s"
    res = runner.invoke(app, ["chat", "--model", str(tiny_base_model_dir), "--session", "b",
                              "--max-tokens", "6", *cache_args(root), "--panels", "full"],
                        input="Hello there\nAnd again\n", env=WIDE)
    assert res.exit_code == 0, res.output
    assert res.output.count("template none: plain text") == 1  # said once, in the banner
    assert "Traceback" not in res.output
    session = json.loads((root / "b.json").read_text())
    first, second = session["turns"]
    assert session["messages"][0] == {"role": "user", "content": "Hello there"}
    assert second["hit_tokens"] >= first["prompt_tokens"]  # the history is a hit
    # inspect --explain renders a first message the way chat sent it, without the model
    why = runner.invoke(app, ["inspect", "--sessions-dir", str(root), "--json", "--explain",
                              "Hello there"])
    assert why.exit_code == 0, why.output
    assert json.loads(why.output)["miss_reason"] == "hit"
    assert json.loads(why.output)["cached_tokens"] == first["prompt_tokens"]


def test_a_plain_text_history_is_extended_token_for_token(tiny_base_model_dir):
    from kvchat.engine.codec import ChatCodec
    from kvchat.models.loading import load_model
    from kvchat.sessions import Session
    from kvchat.turns import next_prompt

    codec = ChatCodec(load_model(str(tiny_base_model_dir)).tokenizer)
    session = Session("s", "Be brief.")
    first = next_prompt(codec, session, "Hi")
    assert codec.decode(first) == "System: Be brief.\n\nUser: Hi\n\nAssistant:"
    # the reply as generated (it starts with a space, as replies after "Assistant:" do), and
    # the stop string the model went on to write
    session.tokens = first + codec.encode(" Hello.\n\nUser:")
    session.messages = [{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": " Hello."}]
    second = next_prompt(codec, session, "More?")
    assert second[: len(session.tokens)] == session.tokens  # extended, not re-tokenised
    assert codec.decode(second).endswith("User: More?\n\nAssistant:")


def test_batch_sends_a_prompt_as_it_is_and_a_conversation_as_plain_text(tiny_base_model_dir,
                                                                        tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Once upon a time"}\n'
                   '{"system": "Be brief.", "prompt": "Tell me a story."}\n')
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["batch", str(src), "-o", str(out), "--model",
                              str(tiny_base_model_dir), "--max-tokens", "4", "--batch-size", "2",
                              *cache_args(tmp_path / "s")], env=WIDE)
    assert res.exit_code == 0, res.output
    assert flat(res.output).count(NOTICE) == 1
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["prompt_tokens"] for r in rows] == [
        len("Once upon a time"), len(transcript([{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Tell me a story."}],
                                                True))]  # one token per byte
    assert all(r["finish_reason"] in ("length", "stop") for r in rows)


def test_verify_checks_a_base_model(tiny_base_model_dir):
    res = runner.invoke(app, ["verify", "Once upon a time", "--model", str(tiny_base_model_dir),
                              "--max-tokens", "6", "--block-size", "4", "--cache-mb", "8"],
                        env=WIDE)
    assert res.exit_code == 0, res.output
    assert NOTICE in flat(res.output)
    assert "All 4 runs match their reference run bitwise" in flat(res.output)


@pytest.fixture
def base_server(tiny_base_model_dir, tmp_path):
    def start(template: str | None = None):
        options = RuntimeOptions(model=str(tiny_base_model_dir), device="cpu",
                                 sessions_dir=tmp_path / f"s-{template}", chat_template=template,
                                 cache=CacheConfig(4, num_blocks=400))
        return serving(create_app(Runtime.open(options), batch_size=2, max_tokens=5))
    return start


def test_serve_answers_completions_and_refuses_chat_without_a_template(base_server, tmp_path):
    with base_server() as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        assert client.get("/healthz").json()["chat_template"] is False
        refused = client.post("/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 400
        assert "no chat template" in refused.json()["error"]["message"]
        assert "/v1/completions" in refused.json()["error"]["message"]
        done = client.post("/v1/completions", json={"prompt": "Once upon a time",
                                                    "temperature": 0})
        assert done.status_code == 200, done.text
        body = done.json()
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 5
        again = client.post("/v1/completions", json={"prompt": "Once upon a time",
                                                     "temperature": 0}).json()
        assert again["choices"][0]["text"] == body["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len("Once upon a time")
        assert again["kvchat"]["miss_reason"] == "hit"
        with client.stream("POST", "/v1/completions", json={
                "prompt": "Once upon a time", "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as stream:
            lines = [x[6:] for x in stream.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(x) for x in lines[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
            body["choices"][0]["text"]
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        generated = client.post("/generate", json={"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and?"}]}).json()
        assert generated["prompt_tokens"] == len(transcript(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "and?"}], True))


def test_a_chat_template_given_at_start_serves_chat_completions(base_server, tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHAT_TEMPLATE)
    with base_server(str(template)) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        done = client.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "hi"}]})
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["prompt_tokens"] > len("hi") + 20  # templated
        assert client.get("/healthz").json()["chat_template"] is True


def test_plain_text_turns_stop_where_the_model_writes_the_users_next_line():
    from kvchat.models.chat_template import single_prompt

    assert single_prompt([{"role": "user", "content": "x"}]) == "x"
    assert transcript([{"role": "user", "content": "Hi"}, {"role": "assistant",
                                                          "content": " Hello."}], True) == \
        "User: Hi\n\nAssistant: Hello.\n\nAssistant:"
    assert "\n\nUser:" in TRANSCRIPT_STOPS


def test_a_bad_chat_template_option_is_a_clean_error(tiny_base_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    res = runner.invoke(app, ["batch", str(src), "--model", str(tiny_base_model_dir),
                              "--chat-template", "no-such-thing", *cache_args(tmp_path / "s")])
    assert res.exit_code == 2
    assert "--chat-template 'no-such-thing' is not a file" in flat(res.output)
    assert "Traceback" not in res.output


def test_chat_template_names_and_files(tmp_path, tiny_tokenizer):
    from kvchat.models.chat_template import CHATML, resolve

    assert resolve("plain", tiny_tokenizer) is None  # the plain-text format, template or not
    assert resolve("chatml", tiny_tokenizer) == CHATML
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ messages[0]['content'] }}")
    assert resolve(str(jinja), tiny_tokenizer) == "{{ messages[0]['content'] }}"
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    assert resolve(str(config), tiny_tokenizer) == CHAT_TEMPLATE


def test_a_stop_string_is_never_streamed_in_part():
    import torch

    from kvchat.config import SamplingParams
    from kvchat.engine.sequence import Request, Sequence

    def run(text: str, max_new: int = 100, cancel_at: int | None = None) -> tuple[str, str]:
        events: list[object] = []
        seq = Sequence(0, Request([1], SamplingParams(max_new_tokens=max_new,
                                                      stop=TRANSCRIPT_STOPS)), events.append)
        sent = ""
        for i, char in enumerate(text):
            logits = torch.full((300,), -1e9)
            logits[ord(char)] = 0.0
            sent += seq.push(logits, lambda ids: "".join(map(chr, ids)), frozenset(), 10**6)
            if seq.done or i + 1 == cancel_at:
                break
        seq.result = seq.result_of(lambda ids: "".join(map(chr, ids)), 0)
        return sent + seq.unsent(), seq.result.text

    assert run(" Paris.\n\nUser: and") == (" Paris.", " Paris.")  # "\n\nUser" never shown
    assert run(" Hi\n\nUs", max_new=6) == (" Hi\n\nU", " Hi\n\nU")  # held, then flushed
    assert run(" Hi\n\nUs", cancel_at=6) == (" Hi\n\nU", " Hi\n\nU")  # an interrupt too
