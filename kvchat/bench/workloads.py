"""The request files of `kvchat bench batch`, and what a perfect prefix cache reuses on each.

Five deterministic workloads built from a model's tokenizer and chat template, so every runner
sees exactly the same token ids:

- shared-system: N questions after one long system prompt;
- few-shot: items to classify after one header of example Q/A pairs;
- multi-turn: conversations whose turn k extends turn k-1's prompt, interleaved;
- repeats: a few short prompts, each repeated exactly, shuffled;
- unaligned: groups whose prompts share a prefix that ends mid-block (47 and 113 tokens).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from kvchat.cache.radix import common_prefix

Prompts = list[list[int]]

KINDS = ("shared-system", "few-shot", "multi-turn", "repeats", "unaligned")

_TOPICS = [
    "billing", "shipping", "returns", "warranty", "accounts", "security", "privacy", "pricing",
    "discounts", "gift cards", "subscriptions", "refunds", "exchanges", "repairs", "delivery",
    "tracking", "invoices", "taxes", "loyalty points", "student offers", "bulk orders",
    "international orders", "damaged items", "missing parts", "installation", "compatibility",
    "trade-ins", "rentals", "memberships", "cancellations", "pre-orders", "price matching",
]

_LABELS = ("billing", "shipping", "returns", "technical", "other")
_EXAMPLES = [
    ("I was charged twice for the same tent last Tuesday.", "billing"),
    ("My parcel has been stuck at the depot for a week.", "shipping"),
    ("The sleeping bag is too small, how do I send it back?", "returns"),
    ("The stove will not light after I replaced the gas cartridge.", "technical"),
    ("Do you sponsor local climbing clubs?", "other"),
    ("Why does my invoice show a fee I never agreed to?", "billing"),
    ("The courier left my boots at the wrong address.", "shipping"),
    ("Can I exchange the jacket for a larger size?", "returns"),
    ("The headlamp flickers when the battery is full.", "technical"),
    ("Are your stores open on public holidays?", "other"),
    ("My card was declined but the money left my account.", "billing"),
    ("Which carrier do you use for orders to the islands?", "shipping"),
    ("The zip broke on day one, I want a refund.", "returns"),
    ("The GPS watch does not pair with my phone any more.", "technical"),
    ("Can I book a repair slot for my bike through the website?", "other"),
    ("I paid for express delivery but it came by standard post.", "shipping"),
    ("The discount code did not apply at checkout.", "billing"),
]
_ITEMS = [
    "the {t} page charged me in the wrong currency", "my {t} order arrived without a receipt",
    "I want to send back something bought under {t}", "the app crashes when I open {t}",
    "who do I talk to about {t} for a school trip",
    "the {t} form rejects my postcode",
]

_CONVERSATIONS = ["hiking boots", "a tent repair", "camping stoves", "rain jackets",
                  "sleeping bags", "climbing ropes"]
_FOLLOW_UPS = [
    "Hi! I need advice about {t}. Where should I start?",
    "Thanks. What should I check before buying, for {t}?",
    "How long should {t} last with normal use?",
    "What mistakes do beginners make with {t}?",
    "Is there anything I should carry as a spare, for {t}?",
    "Great, can you summarise the advice on {t} in one line?",
    "One more: how do I clean {t} after a trip?",
    "And how do I store {t} over the winter?",
]

_SHORT_QUESTIONS = [
    "What is the capital of France?", "Name a primary colour.", "How many legs has a spider?",
    "What is 12 times 12?", "Spell the word 'river' backwards.", "Which planet is the largest?",
    "What do bees make?", "Give a synonym for 'quick'.", "What is water made of?",
    "Who wrote Hamlet?", "What is the boiling point of water?", "Name a mammal that flies.",
]

_GROUP_SYSTEMS = [
    "You are the trail assistant of the Northern Ridge national park. Visitors ask about "
    "opening hours, trail difficulty, weather warnings, parking, camping permits, dogs on "
    "leads, water sources, mountain huts and emergency numbers. Answer in two sentences, "
    "cite the relevant notice board, and never guess about avalanche conditions.",
    "You are the tasting-room host of a small family vineyard on a sunny hillside. Guests ask "
    "about grape varieties, vintages, food pairings, tour times, group bookings, shipping "
    "cases abroad, allergies and sulphites. Keep every answer friendly and short, mention the "
    "cellar door prices when relevant, and recommend water between tastings.",
]
_TAIL_WORDS = ["Apples", "Bridges", "Candles", "Deserts", "Engines", "Forests", "Glaciers",
               "Harbors", "Islands", "Jungles", "Kettles", "Lanterns", "Meadows", "Nebulas",
               "Orchards", "Pebbles"]


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render(tokenizer: Any, messages: list[dict[str, str]], generation: bool = True) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation))


def shared_system_workload(
    tokenizer: Any, n_requests: int = 32, system_tokens: int = 600
) -> Prompts:
    """n chat prompts: one system prompt of at least system_tokens tokens (with its template),
    then a short distinct question each."""
    rules: list[str] = []
    while True:
        i = len(rules)
        topic = _TOPICS[i % len(_TOPICS)]
        rules.append(f"Rule {i + 1}: questions about {topic} are answered politely, briefly, "
                     f"and only with facts from the {topic} handbook, section {i % 7 + 1}.")
        system = "You are the support assistant of Acme Outdoor Gear. " + " ".join(rules)
        header = render(tokenizer, [{"role": "system", "content": system}], generation=False)
        if len(encode(tokenizer, header)) >= system_tokens:
            break
    return [
        encode(tokenizer, render(tokenizer, [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question {k + 1}: how do {_TOPICS[k % len(_TOPICS)]} "
                                        f"work for order {k}?"},
        ]))
        for k in range(n_requests)
    ]


def few_shot_workload(tokenizer: Any, n_items: int = 24, header_tokens: int = 430) -> Prompts:
    """n classifications after one header: the task, then example Q/A turns until the header
    has at least header_tokens tokens, then the item to classify."""
    system = ("Classify each customer message of an outdoor-gear shop into exactly one label: "
              f"{', '.join(_LABELS)}. Reply with the label only.")
    header = [{"role": "system", "content": system}]
    while len(encode(tokenizer, render(tokenizer, header, generation=False))) < header_tokens:
        n = (len(header) - 1) // 2
        text, label = _EXAMPLES[n % len(_EXAMPLES)]
        round_ = f" (again, {n // len(_EXAMPLES)})" if n >= len(_EXAMPLES) else ""
        header += [{"role": "user", "content": f"Message: {text}{round_}"},
                   {"role": "assistant", "content": label}]
    prompts = []
    for k in range(n_items):
        item = _ITEMS[k % len(_ITEMS)].format(t=_TOPICS[k % len(_TOPICS)])
        prompts.append(encode(tokenizer, render(
            tokenizer, [*header, {"role": "user", "content": f"Message: {item} (#{k + 1})."}])))
    return prompts


def _conversation(tokenizer: Any, system: str, topic: str, turns: int) -> Prompts:
    """One chat's prompts: each turn extends the previous turn's token ids (as a chat session
    does) with a scripted assistant reply and the next user message."""
    messages = [{"role": "system", "content": system}]
    text = ""
    ids: list[int] = []
    out: Prompts = []
    for t in range(turns):
        if t:
            messages.append({"role": "assistant", "content": (
                f"Here is part {t} on {topic}: pick gear that fits, try it at home before a "
                "trip, and keep the receipt in case it has to go back.")})
        messages.append({"role": "user", "content": _FOLLOW_UPS[t % len(_FOLLOW_UPS)]
                         .format(t=topic)})
        full = render(tokenizer, messages)
        # the template re-renders earlier turns verbatim; where one does not, tokenise it whole
        if full.startswith(text):
            ids = ids + encode(tokenizer, full[len(text):])
        else:
            ids = encode(tokenizer, full)
        text = full
        out.append(list(ids))
    return out


def multi_turn_workload(tokenizer: Any, conversations: int = 4, turns: int = 6) -> Prompts:
    """conversations x turns prompts, interleaved by turn: turn k of every chat, then turn k+1.
    The chats share their system prompt; each turn's prompt extends its previous one."""
    system = "You are a friendly outdoor guide for a gear shop. Answer in two sentences."
    chats = [_conversation(tokenizer, system, _CONVERSATIONS[c % len(_CONVERSATIONS)]
                           + (f" ({c // len(_CONVERSATIONS) + 1})" if c >= len(_CONVERSATIONS)
                              else ""), turns)
             for c in range(conversations)]
    return [chats[c][t] for t in range(turns) for c in range(conversations)]


def repeats_workload(tokenizer: Any, distinct: int = 10, copies: int = 3, seed: int = 0) -> (
    Prompts
):
    """distinct short prompts, each `copies` times, in a seeded shuffled order."""
    prompts = [
        encode(tokenizer, render(tokenizer, [{"role": "user", "content": (
            _SHORT_QUESTIONS[k % len(_SHORT_QUESTIONS)]
            + (f" ({k // len(_SHORT_QUESTIONS) + 1})" if k >= len(_SHORT_QUESTIONS) else ""))}]))
        for k in range(distinct)
    ]
    order = [k for k in range(distinct) for _ in range(copies)]
    random.Random(seed).shuffle(order)
    return [list(prompts[k]) for k in order]


def unaligned_workload(tokenizer: Any, shared: Sequence[int] = (47, 113), per_group: int = 8) -> (
    Prompts
):
    """One group per entry of `shared`: per_group prompts whose first n tokens are the same and
    whose next token differs pairwise and from the group's base text, so every two prompts of
    a group share exactly n tokens, a prefix that ends inside a block."""
    prompts: Prompts = []
    for g, n in enumerate(shared):
        system = _GROUP_SYSTEMS[g % len(_GROUP_SYSTEMS)]
        base = encode(tokenizer, render(tokenizer, [{"role": "system", "content": " ".join(
            [system] * (1 + n // 40))}], generation=False))
        if len(base) <= n:
            raise ValueError(f"the group's base text has {len(base)} tokens, not over {n}")
        firsts = {base[n]}
        tails: Prompts = []
        for word in _TAIL_WORDS:
            tail = encode(tokenizer, f"{word}: question {len(tails) + 1} of group {g + 1}."
                          "<|im_end|>\n<|im_start|>assistant\n")
            if tail[0] not in firsts:
                firsts.add(tail[0])
                tails.append(tail)
            if len(tails) == per_group:
                break
        if len(tails) < per_group:
            raise ValueError(f"only {len(tails)} prompts diverge at token {n}, not {per_group}")
        prompts += [base[:n] + tail for tail in tails]
    return prompts


def build_workload(kind: str, tokenizer: Any, requests: int = 32, system_tokens: int = 600) -> (
    Prompts
):
    """The prompts of one kind; `requests` and `system_tokens` size shared-system only."""
    builders: dict[str, Callable[[], Prompts]] = {
        "shared-system": lambda: shared_system_workload(tokenizer, requests, system_tokens),
        "few-shot": lambda: few_shot_workload(tokenizer),
        "multi-turn": lambda: multi_turn_workload(tokenizer),
        "repeats": lambda: repeats_workload(tokenizer),
        "unaligned": lambda: unaligned_workload(tokenizer),
    }
    if kind not in builders:
        raise ValueError(f"unknown workload kind {kind!r}; known: {', '.join(KINDS)}")
    return builders[kind]()


shared_prefix = common_prefix  # the longest common prefix of two token sequences


def ideal_prefill(prompts: Prompts) -> int:
    """Prompt tokens a perfect prefix cache computes: each distinct prefix once."""
    seen: set[tuple[int, ...]] = set()
    for p in prompts:
        for i in range(1, len(p) + 1):
            seen.add(tuple(p[:i]))
    return len(seen)


def ideal_hits(prompts: Prompts) -> int:
    """Cache-hit tokens of a perfect prefix cache that sees the lines in file order: per line,
    its longest shared prefix with any earlier line, all of it for an exact repeat, else at most
    len - 1 (one prompt token is always computed, as kvchat does on a non-exact hit)."""
    trie: dict[int, Any] = {}
    seen: set[tuple[int, ...]] = set()
    total = 0
    for p in prompts:
        node, shared = trie, 0
        for tok in p:  # walk the earlier lines' tokens as far as this line follows them
            if tok not in node:
                break
            node, shared = node[tok], shared + 1
        total += len(p) if tuple(p) in seen else max(0, min(shared, len(p) - 1))
        seen.add(tuple(p))
        node = trie
        for tok in p:
            node = node.setdefault(tok, {})
    return total
