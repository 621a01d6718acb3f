"""The recorder every batch runner shares (`kvchat.batch.recorder.LineRun`): each result counted
once, --fail-fast stopping at the first failure, results in input order whatever order they came
in, a not-run result for every line that has none, and all of it under the runner's lock."""

from __future__ import annotations

import json
import threading

from kvchat.batch import BatchItem, ItemResult, LineRun, parse_line
from kvchat.batch.attached import AttachedRun
from kvchat.batch.peer import PeerReply, PeerRun
from kvchat.batch.recorder import NOT_FINISHED, NOT_STARTED
from kvchat.batch.run import BatchRun
from kvchat.responses import result_from_fields


def items(n: int) -> list[BatchItem]:
    return [parse_line(json.dumps({"prompt": f"line {k}"}), k) for k in range(1, n + 1)]


def reply(prompt: int, hit: int, completion: int) -> dict[str, object]:
    return {"text": "ok", "prompt_tokens": prompt, "completion_tokens": completion,
            "cache_hit_tokens": hit, "disk_hit_tokens": 0, "shared_hit_tokens": 0,
            "hit_source": "radix", "miss_reason": "hit", "miss_label": "shared prefix",
            "diverged_at": None, "miss_detail": "", "finish_reason": "stop",
            "draft_tokens": 0, "draft_accepted": 0, "replayed_tokens": 0, "ttft_ms": 3.5,
            "total_ms": 9.25}


class Listed(LineRun):
    """A runner whose lines' results are given: `run` records them in the order given."""

    def __init__(self, lines: list[BatchItem], given: list[ItemResult], fail_fast: bool = False,
                 lock: threading.Lock | None = None) -> None:
        self.updates: list[tuple[int, bool]] = []  # (line, whether the lock was held)
        super().__init__(lines, fail_fast, self._update, lock)
        self.given, self.stopped, self.lock = given, False, lock

    def _update(self, res: ItemResult) -> None:
        self.updates.append((res.item.line, self.lock is not None and self.lock.locked()))

    def run(self) -> None:
        for res in self.given:
            if self.stopped:
                return
            self._record(res)

    def stop(self) -> None:
        self.stopped = True


def test_each_result_is_counted_once_and_kept_in_input_order():
    lines = items(4)
    given = [ItemResult(lines[2], result=result_from_fields(reply(10, 4, 3))),
             ItemResult(lines[0], error="the request did not run"),
             ItemResult(lines[1], result=result_from_fields(reply(20, 16, 5)))]
    run = Listed(lines, given)
    run.run()
    p = run.progress
    assert (p.done, p.failed, p.prompt_tokens, p.hit_tokens, p.completion_tokens) == (
        3, 1, 30, 20, 8)
    assert p.hit_rate == 20 / 30
    assert [r.item.line for r in run.ordered()] == [1, 2, 3]
    assert run.updates == [(3, False), (1, False), (2, False)]  # each handed on once, as it came
    left = run.not_started()
    assert [(r.item.line, r.error, r.not_started) for r in left] == [(4, NOT_STARTED, True)]
    assert 4 not in run.results  # a line that never ran is not recorded


def test_a_not_started_result_is_done_but_not_a_failure():
    lines = items(2)
    run = Listed(lines, [ItemResult(lines[0], error=NOT_STARTED, not_started=True)])
    run.run()
    assert (run.progress.done, run.progress.failed) == (1, 0)


def test_fail_fast_stops_at_the_first_failure():
    lines = items(3)
    given = [ItemResult(lines[0], result=result_from_fields(reply(5, 0, 1))),
             ItemResult(lines[1], error="boom"),
             ItemResult(lines[2], result=result_from_fields(reply(5, 0, 1)))]
    run = Listed(lines, given, fail_fast=True)
    run.run()
    assert run.stopped and [r.item.line for r in run.ordered()] == [1, 2]
    assert [r.item.line for r in run.not_started()] == [3]
    run = Listed(lines, given)  # without it every line runs
    run.run()
    assert [r.item.line for r in run.ordered()] == [1, 2, 3] and run.progress.failed == 1


def test_the_result_is_recorded_and_handed_on_under_the_runners_lock():
    lines = items(2)
    lock = threading.Lock()
    run = Listed(lines, [ItemResult(lines[1], error="x"), ItemResult(lines[0], error="y")],
                 lock=lock)
    run.run()
    assert run.updates == [(2, True), (1, True)] and not lock.locked()


def test_every_runner_is_a_line_run_and_says_how_a_line_did_not_run():
    assert issubclass(BatchRun, LineRun) and BatchRun.not_run == NOT_STARTED
    assert issubclass(AttachedRun, LineRun) and AttachedRun.not_run == NOT_FINISHED
    assert issubclass(PeerRun, LineRun) and PeerRun.not_run == NOT_FINISHED


def test_a_servers_reply_reads_back_into_the_result_it_reports():
    from kvchat.responses import result_fields

    doc = reply(12, 8, 4)
    r = result_from_fields(doc)
    assert result_fields(r) == doc  # the row holds exactly what the server sent
    assert (r.completion_tokens, r.computed_tokens, r.prefill_ms) == (4, 4, 3.5)


def test_another_engines_reply_counts_what_it_reported():
    lines = items(1)
    peer_reply = PeerReply("ok", "stop", 9, 2, None, 1.0, 2.0, 0.0, "llama.cpp", {})
    run = Listed(lines, [ItemResult(lines[0], result=peer_reply)])
    run.run()
    assert (run.progress.prompt_tokens, run.progress.hit_tokens) == (9, 0)


def test_the_summary_counts_each_kind_of_end_apart_and_says_why_no_saving_is_timed():
    from rich.console import Console

    from kvchat.ui.batch_view import summary_table

    lines = items(5)
    cut = {**reply(40, 40, 3), "finish_reason": "interrupted"}
    given = [ItemResult(lines[0], result=result_from_fields(reply(40, 40, 2))),  # all hits
             ItemResult(lines[1], result=result_from_fields(cut)),
             ItemResult(lines[2], error="the request did not run"),
             ItemResult(lines[3], error=NOT_STARTED, not_started=True)]
    run = Listed(lines, given)
    run.run()
    p = run.progress
    assert (p.done, p.failed, p.cut_short, p.not_started, p.ended) == (4, 1, 1, 1, 2)
    console = Console(width=200, record=True)
    console.print(summary_table(p, run.ordered(), 1, None, 1.0, unrecorded=1))
    text = " ".join(console.export_text().split())
    assert "requests 1 finished, 2 failed, 1 cut short, 2 not started" in text
    assert "prefill time saved (est.) – (no miss of 32+ tokens to time)" in text
    # an engine that reports no prefill time (a peer's replies) cannot time its misses
    missed = [ItemResult(lines[0], result=PeerReply("ok", "stop", 400, 5, None, 0.0, 9.0, 0.0,
                                                    "vllm", {})),
              ItemResult(lines[1], result=PeerReply("ok", "stop", 400, 5, 300, 0.0, 9.0, 0.0,
                                                    "vllm", {}))]
    peer = Listed(lines[:2], missed)
    peer.run()
    console = Console(width=200, record=True)
    console.print(summary_table(peer.progress, peer.ordered(), 0, None, 1.0))
    assert "– (the engine reports no prefill time)" in " ".join(console.export_text().split())


def test_an_attached_session_line_asks_the_server_to_keep_no_cut_short_turn():
    """What --resume sends again must not be in the server's session already."""
    from kvchat.batch.attached import request_body
    from kvchat.config import SamplingParams
    from kvchat.server.schemas import GenerateBody

    line = parse_line(json.dumps({"session": "cy", "prompt": "Hi"}), 1)
    body = request_body(line, SamplingParams(max_new_tokens=4), cut_turns_out=True)
    assert body["session"] == "cy" and body["keep_interrupted"] is False
    assert GenerateBody(**body).keep_interrupted is False
    # a server whose /healthz does not say it takes the field (an earlier one) is not sent it
    assert "keep_interrupted" not in request_body(line, SamplingParams(max_new_tokens=4))
    plain = request_body(parse_line(json.dumps({"prompt": "Hi"}), 2), SamplingParams())
    assert "keep_interrupted" not in plain and GenerateBody(**plain).keep_interrupted
