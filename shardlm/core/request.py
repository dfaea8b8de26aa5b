"""A request as the engine core sees it: token ids, progress, state."""

from __future__ import annotations

import enum
import hashlib
import os
import time
from array import array

from shardlm.lora.request import LoRARequest
from shardlm.sampling_params import SamplingParams

# A secret per process: nobody outside can craft a prompt whose blocks collide with another
# user's cached KV (vLLM CVE-2025-25183 did that with Python's predictable hash of ints).
_PREFIX_HASH_KEY = os.urandom(16)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


def hash_block_tokens(parent_hash: bytes | None, tokens: tuple[int, ...], extra: bytes = b"") -> bytes:
    """Prefix-cache key of one full block: depends on every token before it through the chain
    (the first block's parent is the request's cache salt, e.g. its LoRA adapter's), and on
    `extra`: the content hashes of the images whose placeholder tokens it holds (the tokens alone
    are the same for every image). Keyed BLAKE2b (128 bits) over the parent's key and the tokens."""
    h = hashlib.blake2b(parent_hash or b"", key=_PREFIX_HASH_KEY, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: list[int], max_model_len: int, block_size: int,
                 arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                 pooling_params=None, token_type_ids: list[int] | None = None, priority: int = 0,
                 cache_salt: str | None = None, mm_items: list | None = None):
        """cache_salt: mixed into its prefix-cache keys (with its adapter's): only requests with the
        same salt share its cached blocks (vLLM's, for tenants that must not share a cache)."""
        self.request_id = request_id
        self.priority = priority                  # --scheduling-policy priority: lower runs first
        self.seq = 0                              # the order the scheduler received it in
        self.scheduled_time: float | None = None  # when first scheduled (reported with its first output)
        self.scheduled_time_sent = False
        self.execute_seconds = self.forward_seconds = 0.0     # --collect-detailed-traces: its steps' times
        self.pooling_params = pooling_params      # a pooling request: one step, its result instead of tokens
        self.token_type_ids = token_type_ids
        self.mm_items = mm_items                  # its images (messages.MultiModalItem), in prompt order
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set(eos_token_ids)
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1      # prefix-cache hit at first scheduling (-1: not yet)
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []    # speculative decoding: proposed for its next decode
        self.spec_lookahead = 0                # ... at most this many (0: none until spec_resume_at output tokens)
        self.spec_resume_at = 0
        room = max_model_len - len(prompt_token_ids)
        if sampling_params.max_tokens is not None and sampling_params.max_tokens > room:
            # the processor refuses such requests (check_max_tokens); the scheduler relies on it
            raise ValueError(f"max_tokens={sampling_params.max_tokens} exceeds the {room} tokens left in the context")
        self.max_tokens = room if sampling_params.max_tokens is None else sampling_params.max_tokens
        self.block_size = block_size
        self.lora_request = lora_request
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        salts = [s for s in (lora_request.cache_salt if lora_request is not None else None,
                             cache_salt.encode() if cache_salt else None) if s]
        self._cache_salt = b"\0".join(salts) if salts else None
        self.block_hashes: list[int] = []
        self._update_block_hashes()
        self.grammar = None              # structured outputs: a Future of the request's matcher
        self.grammar_done = False        # the constraint is complete: the request ends
        self.ended_by_stop_token = False  # its last token is an EOS or one of stop_token_ids (no text shown)
        self.thinking_end_ids: list[int] | None = None    # reasoning models: the constraint waits for these

    @property
    def waiting_for_grammar(self) -> bool:
        return self.grammar is not None and not self.grammar.done()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.all_token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else self._cache_salt
            self.block_hashes.append(hash_block_tokens(parent, tuple(self.all_token_ids[i * bs:(i + 1) * bs]),
                                                       self._images_in(i * bs, (i + 1) * bs)))

    def _images_in(self, start: int, end: int) -> bytes:
        """The content hashes of the images with placeholder tokens among positions start .. end - 1."""
        if not self.mm_items:
            return b""
        return b"".join(item.hash.encode() for item in self.mm_items
                        if item.offset < end and start < item.offset + item.length)

    def check_stop(self) -> bool:
        """After a token was appended: set a finished status if a stop condition holds."""
        token = self.output_token_ids[-1]
        sp = self.sampling_params
        if self.grammar_done:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if self.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in self.eos_token_ids:
                self.status, self.ended_by_stop_token = RequestStatus.FINISHED_STOPPED, True
                return True
            if token in sp.stop_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, token
                self.ended_by_stop_token = True
                return True
        if self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
