"""What `kvchat bench fleet` measured: one run per setup and kind, and the bench they make.

Plain data, no torch, beside results.py: bench/fleet.py builds these, ui/fleet_view.py renders
them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvchat.cache.stats import ratio


@dataclass(frozen=True)
class FleetRun:
    """One workload kind through one fleet setup: `instances` kvchat serve behind the router
    with `policy` (None: one instance, no router), their block store shared or each its own."""

    setup: str
    instances: int
    policy: str | None
    shared: bool
    kind: str
    requests: int
    prompt_tokens: int  # as the servers counted them (usage.prompt_tokens)
    hit_tokens: int  # usage.prompt_tokens_details.cached_tokens, summed
    shared_hit_tokens: int  # of those, blocks another instance put in the shared store
    completion_tokens: int
    seconds: float
    failures: int = 0

    @property
    def hit_rate(self) -> float:
        return ratio(self.hit_tokens, self.prompt_tokens)

    @property
    def requests_per_s(self) -> float:
        return ratio(self.requests - self.failures, self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return ratio(self.completion_tokens, self.seconds)


@dataclass(frozen=True)
class FleetBench:
    """`kvchat bench fleet`: every setup on every kind, in one run; the one-instance runs are
    the reference hit rates."""

    instances: int
    router: str
    concurrency: int
    new_tokens: int
    threads: dict[int, int]  # torch threads per instance, by fleet size
    runs: tuple[FleetRun, ...]

    def single(self, kind: str) -> FleetRun | None:
        return next((r for r in self.runs if r.kind == kind and r.instances == 1), None)

    def of_single(self, run: FleetRun) -> float | None:
        """The run's hit rate over the one instance's on the same kind."""
        ref = self.single(run.kind)
        return None if ref is None or not ref.hit_rate else run.hit_rate / ref.hit_rate

    def as_dict(self) -> dict[str, Any]:
        return {"instances": self.instances, "router": self.router,
                "concurrency": self.concurrency, "new_tokens": self.new_tokens,
                "threads_per_instance": self.threads,
                "runs": [{**asdict(r), "hit_rate": r.hit_rate, "of_single": self.of_single(r),
                          "requests_per_s": r.requests_per_s, "tokens_per_s": r.tokens_per_s}
                         for r in self.runs]}
