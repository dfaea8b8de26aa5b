"""Custom logits processors, with vLLM v1's interface (vllm.v1.sample.logits_processor):
a class the engine loads at start-up (`--logits-processors pkg.mod:Cls`, `LLM(logits_processors=
[Cls])`, or the `shardlm.logits_processors` entry-point group), which sees the whole batch of
logits each step and changes the rows of the requests that ask for it, usually through
`SamplingParams.extra_args` (the server's `vllm_xargs`).

The engine keeps the processor's view of the batch up to date with `update_state`: before each
step's `apply`, it says which requests left the batch, which came (with their parameters and a
live reference to their output tokens) and which moved, in that order of processing. Row i of
`apply`'s logits is the request the processor last saw at index i.

Where shardlm differs from vLLM: the batch is the step's sampled requests (a request whose
prompt is still being prefilled over several steps leaves it and comes back when it samples),
and the `vllm_config` a processor gets is shardlm's EngineConfig (`.model`, `.scheduler`, ...).
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from functools import partial
from importlib.metadata import entry_points

import torch

from shardlm.sampling_params import SamplingParams

ENTRY_POINT_GROUP = "shardlm.logits_processors"


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()    # the request at a goes to b (b held none, or its request was replaced)
    SWAP = auto()              # the requests at a and b change places


# (index, params, prompt token ids, output token ids: the request's own list, which grows)
AddedRequest = tuple[int, SamplingParams, "list[int] | None", "list[int]"]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step; processed as removed, then added, then moved."""
    batch_size: int
    removed: Sequence[int]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for parameters this processor cannot take (the request is refused)."""

    @abstractmethod
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        ...

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [batch_size, vocab] float32 -> the processed logits (in place or new)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True where the processor never changes a row's argmax (greedy rows then skip it, and it
        runs after temperature, before top-k/top-p); False: it runs first, for every row."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every apply; None where no request came, left or moved."""


# a request's own processor: (output ids, logits row) -> row, or (prompt ids, output ids, row) -> row
RequestLogitsProcessor = Callable[..., torch.Tensor]


class AdapterLogitsProcessor(LogitsProcessor):
    """Per-request processors as one batch processor: subclass it, say `is_argmax_invariant`,
    and return each request's processor (or None) from `new_req_logits_processor`."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}   # index -> row -> row

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        ...

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.req_info.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            fn = self.new_req_logits_processor(params)
            if fn is None:
                self.req_info.pop(index, None)
            else:       # vLLM's two forms: (output ids, row) or (prompt ids, output ids, row)
                takes_prompt = len(inspect.signature(fn).parameters) == 3
                self.req_info[index] = partial(fn, prompt_ids, output_ids) if takes_prompt else partial(fn, output_ids)
        move_entries(self.req_info, batch_update.moved)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, process in self.req_info.items():
            row = logits[index]
            new = process(row)
            if new is not row:
                logits[index] = new
        return logits


def move_entries(entries: dict, moved: Sequence[MovedRequest]) -> None:
    """A processor's per-index dict after the batch's moves (what most processors need)."""
    for a, b, direction in moved:
        at_a, at_b = entries.pop(a, None), entries.pop(b, None)
        if at_a is not None:
            entries[b] = at_a
        if direction is MoveDirectionality.SWAP and at_b is not None:
            entries[a] = at_b


def load_logits_processors(given: Sequence[str | type] | None) -> list[type[LogitsProcessor]]:
    """The classes given (objects, or 'pkg.mod:Cls' / 'pkg.mod.Cls' names) and the installed ones
    of the entry-point group, each checked to be a LogitsProcessor; ValueError naming what is wrong."""
    named = [(g if isinstance(g, str) else getattr(g, "__qualname__", repr(g)), g) for g in given or []]
    named += [(ep.value, ep.value) for ep in entry_points(group=ENTRY_POINT_GROUP)]
    classes = []
    for name, item in named:
        cls = _import_class(item) if isinstance(item, str) else item
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"Logits processor {name} is not a subclass of shardlm.logits_processor.LogitsProcessor "
                             "(vLLM's interface: validate_params, __init__(vllm_config, device, is_pin_memory), apply, "
                             "is_argmax_invariant, update_state).")
        if cls not in classes:
            classes.append(cls)
    return classes


def engine_logits_processors(config) -> list[type[LogitsProcessor]]:
    """An engine's processor classes, given and installed (none under speculative decoding or a
    pooling model, which refuse given ones: engine/feature_rules.py)."""
    if config.speculative is not None or config.model.runner == "pooling":
        return []
    return load_logits_processors(config.model.logits_processors)


def _import_class(name: str):
    module_name, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"--logits-processors {name}: give a class as 'package.module:Class' or "
                         "'package.module.Class'.")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:      # noqa: BLE001 - whatever the import raises, the user must see it named
        raise ValueError(f"--logits-processors {name}: module {module_name} failed to import "
                         f"({type(e).__name__}: {e}); is it on PYTHONPATH?") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"--logits-processors {name}: module {module_name} has no {attr}.") from None
