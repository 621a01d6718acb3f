"""The order a batch goes to a remote engine (`kvchat.batch.order`): lines grouped by the prompt
text they share, each group's first line alone until it is prefilled, session lines as chains."""

from __future__ import annotations

from kvchat.batch.order import (
    MIN_SHARED_CHARS,
    Group,
    SendQueue,
    input_order,
    prompt_text,
    shared_prefix_groups,
)

SYS_A = "You answer questions about the sea, in one sentence. " * 3
SYS_B = "You answer questions about mountains, in one sentence. " * 3


def text(system: str, user: str) -> str:
    return prompt_text([{"role": "system", "content": system}, {"role": "user", "content": user}])


def drain(queue: SendQueue) -> list[int]:
    """Every line in the order `take` gives them when each is done (prefilled) at once."""
    sent = []
    while not queue.empty:
        line = queue.take()
        assert line is not None, "nothing may go although nothing is in flight"
        sent.append(line)
        queue.done(line)
    return sent


def test_lines_sharing_a_system_prompt_form_a_group_led_by_its_first_in_text_order() -> None:
    prompts = [(1, text(SYS_A, "waves?")), (2, text(SYS_B, "peaks?")), (3, text(SYS_A, "tides?")),
               (4, prompt_text([{"role": "user", "content": "hello"}])),
               (5, text(SYS_B, "glaciers?"))]
    groups = shared_prefix_groups(prompts)
    assert [g.lines for g in groups] == [(3, 1), (5, 2), (4,)]  # by earliest line
    assert groups[0].shared == len(text(SYS_A, ""))  # the system prompt and the user header
    assert groups[2].shared == 0


def test_a_short_common_head_is_not_a_group() -> None:
    head = "x" * (MIN_SHARED_CHARS - 10)
    prompts = [(1, text(head + "one thing", "a")), (2, text(head + "another", "a"))]
    assert [g.lines for g in shared_prefix_groups(prompts)] == [(1,), (2,)]


def test_a_groups_first_line_goes_alone_until_it_is_prefilled() -> None:
    queue = SendQueue([Group((1, 3, 5), 100), Group((2, 4), 100)])
    assert queue.take() == 1
    assert queue.take() is None  # its group waits for its prefill...
    queue.prefilled(1)
    assert [queue.take(), queue.take()] == [3, 5]  # ...then follows at once
    assert queue.take() == 2  # the next group's leader once this group is all sent
    assert queue.take() is None
    queue.done(3)  # a line of another group finishing releases nothing
    assert queue.take() is None
    queue.prefilled(2)
    assert queue.take() == 4
    assert queue.take() is None and queue.empty


def test_a_leader_that_fails_before_any_text_still_releases_its_group() -> None:
    queue = SendQueue([Group((1, 2), 100)])
    assert queue.take() == 1 and queue.take() is None
    queue.done(1)
    assert queue.take() == 2


def test_groups_of_one_flow_freely_and_input_order_holds_nothing_back() -> None:
    queue = SendQueue(input_order([4, 2, 9]))
    assert [queue.take(), queue.take(), queue.take(), queue.take()] == [4, 2, 9, None]
    assert queue.empty


def test_chains_run_one_line_at_a_time_each_after_the_previous_finished() -> None:
    queue = SendQueue([Group((7,), 0)], chains=[[1, 3], [2]])
    assert [queue.take(), queue.take(), queue.take()] == [1, 2, 7]
    assert queue.take() is None
    queue.prefilled(1)  # a chain's next turn needs the previous one done, not prefilled
    assert queue.take() is None
    queue.done(1)
    assert queue.take() == 3 and queue.take() is None and queue.empty


def test_every_line_goes_exactly_once() -> None:
    groups = [Group((1, 2, 3), 80), Group((4,), 0), Group((5, 6), 80)]
    assert sorted(drain(SendQueue(groups, chains=[[7, 8], [9]]))) == list(range(1, 10))
