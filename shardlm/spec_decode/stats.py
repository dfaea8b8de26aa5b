"""Speculative decoding counters, vLLM's: drafts, drafted and accepted tokens, acceptance per
position. The scheduler counts them; `stats()` carries them to /metrics and the log line."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0                  # verified proposals (one per request per step that had any)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)   # [j]: drafts accepted at position j

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def as_dict(self) -> dict:
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_position": list(self.accepted_per_position)}

    @classmethod
    def from_dict(cls, d: dict) -> SpecDecodingStats:
        return cls(d["spec_num_drafts"], d["spec_num_draft_tokens"], d["spec_num_accepted_tokens"],
                   list(d["spec_accepted_per_position"]))

    @classmethod
    def total(cls, many: list[SpecDecodingStats]) -> SpecDecodingStats:
        width = max((len(s.accepted_per_position) for s in many), default=0)
        return cls(sum(s.num_drafts for s in many), sum(s.num_draft_tokens for s in many),
                   sum(s.num_accepted_tokens for s in many),
                   [sum(s.accepted_per_position[j] for s in many if j < len(s.accepted_per_position))
                    for j in range(width)])

    def minus(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """The counts since `earlier` (for a log interval)."""
        before = earlier.accepted_per_position + [0] * len(self.accepted_per_position)
        return SpecDecodingStats(self.num_drafts - earlier.num_drafts,
                                 self.num_draft_tokens - earlier.num_draft_tokens,
                                 self.num_accepted_tokens - earlier.num_accepted_tokens,
                                 [a - b for a, b in zip(self.accepted_per_position, before)])

    def describe(self, seconds: float) -> str:
        """vLLM's log line, over an interval of `seconds`."""
        drafts = max(self.num_drafts, 1)
        per_position = ", ".join(f"{n / drafts:.3f}" for n in self.accepted_per_position)
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return (f"SpecDecoding metrics: Mean acceptance length: {1 + self.num_accepted_tokens / drafts:.2f}, "
                f"Accepted throughput: {self.num_accepted_tokens / seconds:.2f} tokens/s, "
                f"Drafted throughput: {self.num_draft_tokens / seconds:.2f} tokens/s, "
                f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {per_position}, Avg Draft acceptance rate: {100 * rate:.1f}%")
