"""Speculative decoding (vLLM's --speculative-config): cheap proposals, verified in one pass.

    proposer.py     what the model runner asks of a proposer; selector.py: which one a config makes
    ngram.py        proposals from the request's own tokens (prompt lookup)
    draft_model.py  a draft model beside the target, and the decoding in scratch blocks it
                    shares with EAGLE heads (eagle.py)
    verify.py       which proposed tokens a step keeps: exact for greedy and for sampling
    stats.py        drafted and accepted counts: /metrics and the periodic log line

How a step goes: after sampling, the rank that samples proposes up to k tokens per request
(ModelRunnerOutput.draft_token_ids). The scheduler gives the request's next decode 1 + k
positions (KV slots included) instead of one. The runner samples every one of those positions
from the target model, each with the drafts before it as its history, and keeps the drafts up
to the first one that differs from the sampled token, plus that sampled token: 1 to k + 1 new
tokens for one forward pass. The scheduler then hands the rejected positions back (the next
step overwrites their KV).
"""
