"""Which proposed tokens a step keeps.

Every proposer here drafts deterministically (prompt lookup; a draft model would take its
argmax), so the draft distribution q is one-hot on the drafted token x. Speculative sampling
then accepts x with probability min(1, p(x) / q(x)) = p(x) and otherwise draws from
(p - q)+ normalized, which is p without x. Sampling y ~ p and keeping x exactly when y == x
(else emitting y) gives each outcome the same probability: P(x) = p(x), P(y) = p(y). So the
target's own sampler, run at every verified position, is the rejection sampler: outputs keep
the target's distribution, and greedy requests keep their exact tokens.
"""

from __future__ import annotations


def accepted_tokens(sampled: list[int], drafts: list[int]) -> list[int]:
    """sampled: the target's token at each of the 1 + len(drafts) positions (position j sampled
    with drafts[:j] as its history). -> the drafts that match, then the first sampled token
    that does not (or the one after every draft): 1 to len(drafts) + 1 tokens."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return sampled[:j + 1]
    return sampled[:len(drafts) + 1]
