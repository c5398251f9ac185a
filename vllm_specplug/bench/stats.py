"""Statistics of one benchmark run, from per-request counter snapshots.

tau (Spec-Bench's mean accepted tokens) = generated tokens / target forward
steps, where steps = generated - accepted draft tokens: every decoding step,
drafted or not, yields its accepted drafts plus one token. Plain decoding
has tau = 1.00. (vLLM's logged "mean acceptance length" divides by drafted
steps only and so overstates it when some steps have no draft.)
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counters:
    """Totals over some requests."""
    generated: int = 0
    accepted: int = 0
    drafts: int = 0          # steps that had a draft
    draft_tokens: int = 0
    seconds: float = 0.0
    accepted_per_pos: list[int] = field(default_factory=list)
    # first to last token of requests whose engine kept stats: the tokens
    # after the first and their seconds (prefill and queueing left out)
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    def add(self, other: "Counters") -> "Counters":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pos = [(self.accepted_per_pos[i] if i < len(self.accepted_per_pos) else 0)
               + (other.accepted_per_pos[i] if i < len(other.accepted_per_pos) else 0)
               for i in range(n)]
        return Counters(self.generated + other.generated, self.accepted + other.accepted,
                        self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                        self.seconds + other.seconds, pos,
                        self.decode_tokens + other.decode_tokens,
                        self.decode_seconds + other.decode_seconds)

    @property
    def steps(self) -> int:
        return self.generated - self.accepted

    @property
    def tau(self) -> float:
        return self.generated / self.steps if self.steps > 0 else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after each request's first over the time from its first to
        its last token: the rate speculation changes (NaN without stats)."""
        return (self.decode_tokens / self.decode_seconds if self.decode_seconds > 0
                else float("nan"))

    @property
    def draft_tokens_per_step(self) -> float:
        return self.draft_tokens / self.steps if self.steps > 0 else float("nan")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else float("nan")

    def acceptance_per_position(self) -> list[float]:
        """Share of drafted steps whose draft was accepted up to position i+1
        (vLLM's per-position acceptance rate)."""
        if not self.drafts:
            return [float("nan")] * len(self.accepted_per_pos)
        return [a / self.drafts for a in self.accepted_per_pos]


def total(counters) -> Counters:
    out = Counters()
    for c in counters:
        out = out.add(c)
    return out


def speedup(method_tps: float, baseline_tps: float) -> float:
    if not baseline_tps or baseline_tps != baseline_tps:
        return float("nan")
    return method_tps / baseline_tps


def summary(c: Counters, baseline: Counters | None = None) -> dict:
    d = {"generated": c.generated, "accepted": c.accepted, "steps": c.steps,
         "drafts": c.drafts, "draft_tokens": c.draft_tokens, "seconds": round(c.seconds, 4),
         "tau": c.tau, "tokens_per_second": c.tokens_per_second,
         "decode_seconds": round(c.decode_seconds, 4),
         "decode_tokens_per_second": c.decode_tokens_per_second,
         "draft_tokens_per_step": c.draft_tokens_per_step,
         "acceptance_rate": c.acceptance_rate,
         "acceptance_per_position": c.acceptance_per_position()}
    if baseline is not None:
        d["speedup"] = speedup(c.tokens_per_second, baseline.tokens_per_second)
        d["decode_speedup"] = speedup(c.decode_tokens_per_second,
                                      baseline.decode_tokens_per_second)
    return d
