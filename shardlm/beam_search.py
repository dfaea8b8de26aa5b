"""Beam search, as vLLM offers it (LLM.beam_search, and use_beam_search in the server): the engine
stays a sampler, and the search runs above it. Each step asks the engine for one token of every
live beam with 2 x beam_width logprobs (a beam's prompt is its tokens so far, which the prefix
cache mostly holds already); the best beam_width continuations by cumulative logprob go on, those
ending in an end-of-sequence token are set aside as finished, and at the end the beams are ranked
by cumulative logprob over length ** length_penalty (transformers' and vLLM's score)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.outputs import PositionLogprobs
from shardlm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False      # a finished beam's tokens keep its end-of-sequence token

    def __post_init__(self):
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width={self.beam_width!r}: give an integer >= 1.")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: give an integer >= 1.")

    def step_params(self) -> SamplingParams:
        """What one step asks of the engine for each live beam."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature,
                              ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class BeamSearchSequence:
    tokens: list[int]                      # the prompt's and the beam's
    cum_logprob: float = 0.0
    logprobs: list[PositionLogprobs] = field(default_factory=list)     # per generated token
    finish_reason: str | None = None       # "stop" (an end-of-sequence token) or "length"
    text: str | None = None                # the generated text, once the search ends ("" without a tokenizer)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]    # the best beam_width, best first


class BeamSearch:
    """One prompt's search: `live()` the beams to extend next, `advance()` with their steps' logprobs."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids, max_model_len: int):
        self.params, self.eos = params, set(eos_token_ids)
        self.prompt_len, self.max_model_len = len(prompt_token_ids), max_model_len
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.steps = 0

    def live(self) -> list[BeamSearchSequence]:
        """The beams the next step extends (none once max_tokens or the context is reached)."""
        room = self.steps < self.params.max_tokens and self.prompt_len + self.steps < self.max_model_len
        return self.beams if room else []

    def advance(self, positions: list[PositionLogprobs]) -> None:
        """positions: for each live beam, its next token's logprobs (the step's one position)."""
        candidates = []
        for beam, position in zip(self.beams, positions):
            for token, entry in position.items():
                extended = BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + entry.logprob,
                                              beam.logprobs + [position])
                if token in self.eos and not self.params.ignore_eos:
                    extended.finish_reason = "stop"
                    if not self.params.include_stop_str_in_output:
                        extended.tokens.pop()
                    self.finished.append(extended)
                else:
                    candidates.append(extended)
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        self.beams = candidates[:self.params.beam_width]
        self.steps += 1

    def result(self, decode) -> BeamSearchOutput:
        """The best beam_width of the finished and the live beams; decode(ids) -> text."""
        for beam in self.beams:
            beam.finish_reason = "length"
        best = sorted(self.finished + self.beams, key=self._score, reverse=True)[:self.params.beam_width]
        for beam in best:
            beam.text = decode(beam.tokens[self.prompt_len:]) if decode is not None else ""
        return BeamSearchOutput(best)

    def _score(self, beam: BeamSearchSequence) -> float:
        """Cumulative logprob over length ** length_penalty (the prompt counted, an end token not)."""
        length = len(beam.tokens) - (beam.finish_reason == "stop" and self.params.include_stop_str_in_output)
        return beam.cum_logprob / max(length, 1) ** self.params.length_penalty
