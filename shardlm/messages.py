"""Every message that crosses a process boundary, in one place.

Plain msgspec structs of ints, floats, strings and lists (never pickle), so any transport (a
pipe, a shared-memory queue, a Ray call, a socket) carries them as msgpack bytes. This module
imports nothing of shardlm but SamplingParams, PoolingParams, LoRARequest and TokenLogprobs, so every layer may use it.

Three conversations:

    front end (LLM / AsyncLLM)  <->  engine core        EngineCoreRequest, AbortRequests, UtilityCall,
                                                        Shutdown  /  Ready, StartupFailed, Failed,
                                                        EngineCoreOutputs, UtilityResult
                                                        (a remote one first: JoinRequest / JoinAccepted,
                                                        JoinRefused)
    engine core  ->  workers                            SchedulerOutput (in RunStep), UtilityCall, Shutdown
    workers  ->  engine core                            Ready, ModelRunnerOutput (in StepResult), UtilityResult
"""

from __future__ import annotations

from typing import Any

import msgspec

from shardlm.lora.request import LoRARequest
from shardlm.outputs import TokenLogprobs
from shardlm.pooling.params import PoolingParams
from shardlm.sampling_params import SamplingParams


# ---- a prompt's images (multimodal/), front end -> engine core -> workers ----
class TensorData(msgspec.Struct):
    """A tensor as bytes: its shape, its torch dtype's name, its values (C order)."""
    shape: list[int]
    dtype: str
    data: bytes


class MultiModalItem(msgspec.Struct):
    """One image of a prompt: its placeholder tokens (prompt positions offset .. offset + length - 1,
    whose embeddings the vision encoder's output replaces), a hash of its content (the prefix
    cache's key for those positions), and the model's inputs for it (pixel_values, ...)."""
    modality: str
    offset: int
    length: int
    hash: str
    tensors: dict[str, TensorData]


# ---- one step, engine core -> workers ----
class NewRequestData(msgspec.Struct):
    """Sent the first time a request is scheduled; the worker keeps it until the request ends."""
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None    # a pooling request: its result instead of tokens
    token_type_ids: list[int] | None = None        # encoders: each token's segment (a pair's second text: 1)
    mm_items: list[MultiModalItem] | None = None   # its images, in prompt order


class PooledData(msgspec.Struct):
    """A pooling request's result: float32 values of this shape, as bytes."""
    shape: list[int]
    data: bytes


class ScheduledChunk(msgspec.Struct):
    """One request's share of a step: compute `token_ids` at positions start_pos, start_pos+1, ..."""
    req_id: str
    token_ids: list[int]
    start_pos: int
    block_tables: list[list[int]]    # its block ids, one table per KV cache group (kv_cache_groups.py)
    sample: bool          # True when this chunk ends at the request's last known token
    # speculative decoding: the last num_draft_tokens of token_ids are proposed tokens, to verify
    num_draft_tokens: int = 0

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:] if self.num_draft_tokens else []


class SchedulerOutput(msgspec.Struct):
    chunks: list[ScheduledChunk]
    new_requests: list[NewRequestData] = msgspec.field(default_factory=list)
    finished_req_ids: list[str] = msgspec.field(default_factory=list)
    # structured outputs: the constrained requests sampled this step and their allowed tokens,
    # int32 words (bit t: token t allowed), one row per sampled position of each: 1 + its drafts
    grammar_req_ids: list[str] = msgspec.field(default_factory=list)
    grammar_bitmask: bytes = b""
    # speculative decoding: req_id -> how many tokens to propose for its next step, after this one
    propose_drafts: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


# ---- one step's result, output rank -> engine core ----
class ModelRunnerOutput(msgspec.Struct):
    # req_id -> its new tokens: one, or with speculative decoding the accepted drafts and one more
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = msgspec.field(default_factory=dict)    # one per new token
    prompt_logprobs: dict[str, list[TokenLogprobs]] = msgspec.field(default_factory=dict)
    # speculative decoding: tokens proposed for each request's next step
    draft_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # requests whose own part of the step failed (an adapter that could not be read): why. Their
    # rows ran (so every rank ran the same step); their tokens are dropped and they end.
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    pooled: dict[str, PooledData] = msgspec.field(default_factory=dict)    # pooling requests: their results
    forward_seconds: float = 0.0     # --collect-detailed-traces: this rank's forward pass and sampling


# ---- front end <-> engine core ----
class EngineCoreRequest(msgspec.Struct, tag=True):
    """One engine-core request: a prompt already tokenised and validated by the front end."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None
    priority: int = 0              # --scheduling-policy priority: lower runs first
    cache_salt: str | None = None  # its prefix-cache keys' salt: reused only by requests with the same one
    mm_items: list[MultiModalItem] | None = None   # its images, in prompt order (multimodal models)


class EngineCoreOutput(msgspec.Struct):
    """What one step did to one request: its new tokens, and how it ended if it did."""
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_token: bool = False       # the last new token is the EOS or stop token id that ended it
    num_cached_tokens: int = 0
    error: str | None = None       # the request failed: why
    error_kind: str = "engine"     # "engine": its engine core or replica died; "request": its own fault
    pooled: PooledData | None = None    # a pooling request's result (it ends with it)
    scheduled_time: float | None = None     # its first output: when it was first scheduled (wall clock)
    # --collect-detailed-traces, with its last output: the steps it was in, timed on the engine core
    # (executing them) and on the answering worker (its forward passes)
    execute_seconds: float = 0.0
    forward_seconds: float = 0.0


class EngineCoreOutputs(msgspec.Struct, tag=True):
    """One step's outputs, and the core's load (what a data-parallel balancer reads)."""
    outputs: list[EngineCoreOutput]
    num_waiting: int = 0
    num_running: int = 0
    engine_index: int = 0          # the data parallel replica (its rank) that ran them


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


# ---- calls and answers, for both conversations ----
class UtilityCall(msgspec.Struct, tag=True):
    """Call `method` on the other side (the engine core, or every worker) with `args`."""
    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    value: Any
    error: str | None = None       # the call raised this (the engine core and its workers go on)


class StartWave(msgspec.Struct, tag=True):
    """To an engine core: another replica started lock-step wave `number` (core/wave.py)."""
    number: int


class WaveStarted(msgspec.Struct, tag=True):
    """From an engine core: a request made it start wave `number`; the other replicas must join."""
    number: int


class Shutdown(msgspec.Struct, tag=True):
    restart: bool = False        # the engine starts again as a whole: a headless node starts this core again


class Ready(msgspec.Struct, tag=True):
    """Start-up finished: a worker (its rank) or the engine core (its KV cache blocks)."""
    rank: int = 0
    num_blocks: int = 0


class StartupFailed(msgspec.Struct, tag=True):
    error: str


class Failed(msgspec.Struct, tag=True):
    """The engine core stopped on an error (a worker died, ...); it exits after sending this."""
    error: str
    in_failed_steps: list[str] = msgspec.field(default_factory=list)   # the requests of the steps it ran


# ---- a headless node's engine core, or another server's replicas, joining the head (data parallel across nodes) ----
class JoinRequest(msgspec.Struct):
    dp_rank: int
    node: str
    fingerprint: dict[str, str]      # what it runs (engine/dp_remote.py: fingerprint)
    replicas: int = 1                # a server of hybrid load balancing: its replicas from dp_rank on

    @property
    def ranks(self) -> range:
        return range(self.dp_rank, self.dp_rank + self.replicas)


class JoinAccepted(msgspec.Struct, tag=True):
    store_host: str                  # the rendezvous store every rank joins
    store_port: int
    own_world: bool = False          # a replica joining again: its ranks form a world of their own


class JoinRefused(msgspec.Struct, tag=True):
    reason: str


# ---- engine core <-> workers ----
class RunStep(msgspec.Struct, tag=True):
    scheduler_output: SchedulerOutput


class StepResult(msgspec.Struct, tag=True):
    output: ModelRunnerOutput


# What each side decodes.
ToEngineCore = EngineCoreRequest | AbortRequests | UtilityCall | StartWave | Shutdown
FromEngineCore = Ready | StartupFailed | Failed | EngineCoreOutputs | UtilityResult | WaveStarted
ToWorker = RunStep | UtilityCall | Shutdown
FromWorker = Ready | StepResult | UtilityResult
