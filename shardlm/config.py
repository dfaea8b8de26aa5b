"""Engine configuration: one dataclass per concern, resolved once and then only read.

The cache, scheduler, parallel and LoRA configs declare their user knobs (`knob`: default, help,
short flag). `EngineArgs` (engine/arg_utils.py) is the flat list of every user knob, taking
those as declared here; it resolves them into the `EngineConfig` below (model path, dtype,
device, executor backend) and runs the start-up checks, once, in the process the user started.
The resolved config then travels to the engine-core process and to every worker as it is. This
module imports nothing of shardlm but kv_cache_groups (which imports nothing).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property

import torch

from shardlm.kv_cache_groups import KVCacheGroups, one_group, plan_kv_cache_groups, sliding_window

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
               "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4,
               "tb": 1000**4, "tib": 1 << 40}


def json_object_flag(value: dict | str | None, flag: str, example: str) -> dict:
    """A flag given as a JSON object (or, offline, as a dict) -> the dict; a clear error otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not JSON ({e}): give a JSON object, e.g. '{example}'.") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. '{example}', not {type(value).__name__}.")
    return dict(value)


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string such as '4GiB', '512MB', '1e9'."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"Cannot read the size {value!r}: write bytes or a number with a unit, "
                         "e.g. 4GiB, 512MiB, 2GB.")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} TiB"


def knob(default, help: str, short: str | None = None):
    """A field the user sets: its default, its help and an optional short flag, declared once here.
    EngineArgs takes the field as it is (engine/arg_utils.py), and from it come the CLI flag,
    `LLM(**kwargs)` and the user guide's table."""
    return field(default=default, metadata={"help": help, "short": short})


@dataclass
class QuantizationConfig:
    """Weight-only quantization of the linear layers at load (layers/quantization.py)."""
    # "int8", "int4", "fp8_per_channel", "fp8_per_tensor", "fp8_per_block" (quantized at load);
    # "gguf", "gptq", "awq", "fp8", "compressed-tensors" (a checkpoint's: read as stored)
    method: str
    group_size: int          # input columns per (scale, min); -1: one group per row
    source: str | None = None    # gguf: the GGUF file the linears are read from (gptq, awq: the checkpoint)
    weight_bits: int | None = None   # where the method does not say (compressed-tensors: 4 or 8)

    @property
    def bits(self) -> int:
        if self.weight_bits is not None:
            return self.weight_bits
        return 8 if self.method == "int8" or self.method.startswith("fp8") else 4

    @property
    def at_load(self) -> bool:
        """Quantized from the float checkpoint at load (else read as the checkpoint or file stores it)."""
        return self.method in ("int8", "int4") or self.method.startswith("fp8_")

    def effective_bits(self, in_features: int = 4096) -> float:
        """Bits per weight including the float32 scale (and min, but for FP8) of every group."""
        tables = 32 if self.method.startswith("fp8") else 64
        return self.bits + tables / (in_features if self.group_size == -1 else self.group_size)


@dataclass
class MultiModalConfig:
    """A vision-language checkpoint (multimodal/): its text model runs as any other (ModelConfig's
    architecture and hf_config are the text model's), its images through its vision encoder."""
    architecture: str                  # the checkpoint's (LlavaForConditionalGeneration)
    hf_config: object                  # the checkpoint's whole config: vision_config, projector, ...
    image_token_id: int                # the placeholder token an image's embeddings take the place of
    limit_per_prompt: dict[str, int] = field(default_factory=dict)     # --limit-mm-per-prompt
    allowed_local_media_path: str | None = None     # --allowed-local-media-path: file:// images under it
    processor_kwargs: dict = field(default_factory=dict)    # --mm-processor-kwargs: the HF processor's options
    allowed_media_domains: list[str] | None = None  # --allowed-media-domains: http(s) images from these hosts only

    def limit(self, modality: str) -> int:
        return self.limit_per_prompt.get(modality, DEFAULT_ITEMS_PER_PROMPT)


DEFAULT_ITEMS_PER_PROMPT = 999      # vLLM's default limit of images per prompt


@dataclass
class ModelConfig:
    model: str
    tokenizer: str
    hf_config: object  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    seed: int
    architecture: str
    served_model_name: str                   # the first of served_model_names: what the engine reports
    model_impl: str = "shardlm"              # or "transformers": its modeling code (models/transformers_backend.py)
    eos_token_ids: list[int] = field(default_factory=list)
    generation_defaults: dict = field(default_factory=dict)
    quantization: QuantizationConfig | None = None
    enforce_eager: bool = False      # no one-call decode path (models/llama_cpu_decode.py)
    batch_invariant: bool = True     # a row sums alike at any row count (AMX: at every one or none; kernels/amx.py)
    cpu_plan: str | None = None      # --cpu-plan: the CPU plan file to follow or write (cpu_plan.py)
    reasoning_parser: str | None = None      # structured outputs constrain what follows the thinking
    reasoning_parser_plugin: str | None = None    # a file registering reasoning parsers (plugins.py)
    # (hub id, revision, download dir) of a model fetched from the hub: Ray nodes fetch it themselves
    hub_source: tuple[str, str | None, str | None] | None = None
    download_dir: str | None = None          # --download-dir: where hub models and adapters are fetched to
    runner: str = "generate"                 # generate, or pooling (embeddings, classes, scores: pooling/)
    convert: str | None = None               # a generative architecture run as a pooling model: embed, classify
    pooler: object | None = None             # the pooling runner's PoolerConfig (pooling/config.py)
    collect_detailed_traces: bool = False    # steps timed, each request's share reported (tracing)
    disable_log_stats: bool = False          # no periodic stats line (core/stat_logger.py)
    enable_log_requests: bool = False        # AsyncLLM logs each request as it arrives
    max_log_len: int | None = None           # ... with at most this much of its prompt
    enable_log_outputs: bool = False         # ... and each one's outputs as it finishes
    stream_interval: int = 1                 # streamed outputs carry this many new tokens (but the first, last)
    logprobs_mode: str = "raw_logprobs"      # what logprobs report (layers/sampler.py's LOGPROBS_MODES)
    logits_processors: list = field(default_factory=list)   # --logits-processors: classes or names
    skip_tokenizer_init: bool = False        # no tokenizer: token ids in, token ids out (text stays empty)
    enable_sleep_mode: bool = False          # LLM.sleep / wake_up, the server's /sleep and /wake_up
    load_format: str = "auto"                # auto: the checkpoint's weights; dummy: random ones (model_loader)
    trust_remote_code: bool = False          # transformers may run the model repository's config/tokenizer code
    max_logprobs: int = 20                   # --max-logprobs: per token, a request's most; -1: the vocabulary
    served_model_names: list[str] = field(default_factory=list)   # every name a request may give the model
    multimodal: MultiModalConfig | None = None      # a vision-language checkpoint: its images (multimodal/)
    enable_prompt_embeds: bool = False       # prompts may be embeddings (multimodal/prompt_embeds.py)

    def __post_init__(self):
        self.served_model_names = self.served_model_names or [self.served_model_name]
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ValueError("--enable-log-outputs logs beside each logged request: add --enable-log-requests.")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval={self.stream_interval}: give a token count >= 1 (1: every token).")

    @property
    def logprobs_limit(self) -> int:
        """The most logprobs a request may ask for per token (--max-logprobs; -1: the vocabulary)."""
        return self.vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, self.vocab_size)

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer; 0 for a dense model."""
        c = self.hf_config
        return getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 0


# --kv-cache-dtype -> the cache tensors' dtype (None: the model's)
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}


@dataclass
class CacheConfig:
    block_size: int = knob(
        16, "tokens per KV cache block")
    kv_cache_memory: int = knob(
        4 << 30, "CPU: memory for the KV cache, bytes or e.g. 4GiB (vLLM's name: --kv-cache-memory-bytes)")
    kv_cache_dtype: str = knob(
        "auto", "the KV cache's dtype: auto (the model's), fp8 / fp8_e4m3 or fp8_e5m2 (one byte a value, twice "
        "bfloat16's tokens; the checkpoint's k_scale / v_scale per layer, else 1.0)")
    gpu_memory_utilization: float = knob(
        0.9, "CUDA: fraction of device memory for weights, activations and KV cache")
    enable_prefix_caching: bool = knob(
        True, "reuse the KV cache of shared prompt prefixes")
    disable_hybrid_kv_cache_manager: bool = knob(
        False, "keep every position of sliding-window layers (by default the blocks a window has "
        "left behind are freed: kv_cache_groups.py)")
    num_gpu_blocks_override: int | None = knob(
        None, "KV cache blocks to allocate (the null block included), whatever --kv-cache-memory or "
        "--gpu-memory-utilization would give, as vLLM's; to test preemption with a small cache")

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size={self.block_size} must be a positive integer (default 16).")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1].")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: use {', '.join(KV_CACHE_DTYPES)}.")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory} must be a positive number of bytes.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(f"num_gpu_blocks_override={self.num_gpu_blocks_override}: give at least 2 blocks (block "
                             "0 holds nothing).")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = knob(
        256, "most sequences in one step")
    max_num_batched_tokens: int = knob(
        8192, "most tokens in one step (long prompts are prefilled in chunks); default: 8192, or max_num_seqs "
        "where larger")
    max_model_len: int = 8192
    scheduling_policy: str = knob(
        "fcfs", "fcfs (first come, first served) or priority: waiting requests by their `priority` (lower "
        "first, as vLLM), then arrival; the lowest-priority running request is preempted first")
    enable_chunked_prefill: bool = knob(
        True, "prefill a prompt longer than what is left of a step's budget in chunks, beside the running "
        "decodes (as vLLM); --no-enable-chunked-prefill runs each prompt whole in one step, a prompt that "
        "does not fit waiting for a later step (the budget then defaults to at least --max-model-len)")
    long_prefill_token_threshold: int = knob(
        0, "most tokens of one prompt in a step, so that a long prompt leaves room for shorter ones (0: no "
        "bound but the step's)")

    def __post_init__(self):
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r}: use fcfs or priority.")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be positive.")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be positive.")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}): without chunked prefill a prompt runs whole in one step, so longer ones "
                "could never run. Raise --max-num-batched-tokens, lower --max-model-len, or leave chunked prefill on.")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold={self.long_prefill_token_threshold}: give a token "
                             "count >= 0 (0: no bound).")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold cuts prompts into chunks: it needs chunked prefill "
                             "(leave out --no-enable-chunked-prefill).")

    def prompt_tokens_now(self, remaining: int, budget: int, whole: bool = False) -> int:
        """Tokens of a prompt (or a recompute) with `remaining` to go that run in a step with `budget`
        left: a chunk (at most long_prefill_token_threshold), or without chunking all or nothing
        (0: it waits). whole: this request runs whole regardless (a pooled prompt)."""
        if whole or not self.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        return min(remaining, budget, self.long_prefill_token_threshold or remaining)


@dataclass
class EPLBConfig:
    """--eplb-config (vLLM's fields): how expert parallel load balancing measures and moves."""
    window_size: int = 1000                 # steps whose expert loads decide a placement
    step_interval: int = 3000               # steps between placements
    num_redundant_experts: int = 0          # extra expert slots in each EP group, for copies of hot experts
    log_balancedness: bool = False          # log the balancedness every step_interval steps too when unchanged

    @classmethod
    def from_json(cls, value: dict | str) -> EPLBConfig:
        value = json_object_flag(value, "--eplb-config", '{"step_interval": 3000, "num_redundant_experts": 8}')
        known = [f for f in cls.__dataclass_fields__]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"--eplb-config has unknown field(s) {unknown}; known: {', '.join(known)}.")
        return cls(**value)

    def __post_init__(self):
        for name in ("window_size", "step_interval"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"--eplb-config {name}={n!r} must be a positive integer.")
        n = self.num_redundant_experts
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"--eplb-config num_redundant_experts={n!r} must be a non-negative integer.")


@dataclass(frozen=True)
class RayBundles:
    """-dp with the ray executor: where one replica's ranks run, in the placement group the DP
    client made for every replica's ranks (so that replicas sharing a machine share its cores)."""
    address: str                     # the Ray cluster (its GCS address), which the replica's executor joins
    namespace: str                   # the Ray namespace the placement group is named in
    group: str                       # the placement group's name
    bundles: tuple[int, ...]         # per rank of this replica, in rank order: its bundle
    local_ranks: tuple[int, ...]     # per rank: its index among every replica's ranks on its machine
    local_sizes: tuple[int, ...]     # per rank: how many ranks of all replicas share its machine


DEFAULT_DP_RPC_PORT = 29550      # vLLM's: where the servers of one data parallel deployment meet


@dataclass
class ParallelConfig:
    """Sizes are per replica (TP x PCP x PP ranks) and across replicas (DP). A replica's ranks are
    world ranks data_parallel_rank * world_size + 0..world_size-1 of the DP x PP x PCP x TP grid.
    Checks each size on its own; which sizes and features combine is engine/feature_rules.py's."""
    tensor_parallel_size: int = knob(
        1, "number of tensor parallel ranks", short="-tp")
    pipeline_parallel_size: int = knob(
        1, "number of pipeline stages", short="-pp")
    data_parallel_size: int = knob(
        1, "number of data parallel replicas (each an engine core with its own TP x PP ranks and KV cache; "
        "the server spreads requests over them)", short="-dp")
    distributed_executor_backend: str | None = knob(
        None, "uni (one process), mp (processes on this node) or ray (nodes); default: uni for one rank, mp "
        "when every rank fits on this node and this is not a Ray placement group, else ray")
    distributed_init_timeout: float = knob(
        300.0, "seconds to wait for every rank to join before failing with the missing ones")
    cpu_threads_bind: str = knob(
        "auto", "CPU: 'auto' (share this machine's cores evenly among ranks), 'nobind', or one core list per rank "
        "separated by '|', e.g. '0-3|4-7' (pins each rank to its cores)")
    pp_layer_partition: list[int] | None = knob(
        None, "layers per pipeline stage, e.g. 16,14 (default: balanced, the LM head counted as the decoder "
        "layers it weighs on the last stage)")
    allow_cross_node_tp: bool = knob(
        False, "Ray: allow a tensor parallel group to span nodes (two all-reduces per layer over the network; "
        "refused by default)")
    execute_model_timeout: float = knob(
        300.0, "seconds a step of worker processes may take (the first excluded) before the engine fails, naming "
        "the ranks that did not answer (a hung or stopped worker)")
    data_parallel_size_local: int | None = knob(
        None, "replicas this node runs (default: all of them)")
    data_parallel_start_rank: int = knob(
        0, "the first replica this node runs (multi-node data parallel)")
    data_parallel_backend: str = knob(
        "mp", "mp (replicas as processes of this node) or ray (replicas placed on Ray nodes)")
    data_parallel_address: str | None = knob(
        None, "address of the node that runs the API server (multi-node data parallel)")
    data_parallel_rpc_port: int | None = knob(
        None, "port on that address where remote replicas join (multi-node data parallel)")
    data_parallel_hybrid_lb: bool = knob(
        False, "hybrid load balancing, as vLLM's: this server balances its requests over its own replicas "
        "(--data-parallel-size-local from --data-parallel-start-rank) and a load balancer in front spreads "
        "them over the nodes' servers; expert parallel replicas still step together across the servers")
    data_parallel_rank: int = 0                       # this replica (set per engine core by the DP client)
    data_parallel_master: tuple[str, int] | None = None   # the DP-wide rendezvous store (set by the DP client)
    # a replica started again after it died (engine/core_client.py): the others' DP groups still
    # count its old ranks, so its ranks form a world of their own (replicas that do not step together)
    data_parallel_own_world: bool = False
    ray_bundles: RayBundles | None = None     # -dp with the ray executor (set per replica by the DP client)
    enable_expert_parallel: bool = knob(
        False, "MoE models: place whole experts on the ranks of each stage's DP x TP group (each loads only its "
        "experts) instead of slicing every expert across TP; with -dp the replicas run their MoE layers "
        "in lock-step")
    decode_context_parallel_size: int = knob(
        1, "decode context parallel: spread each sequence's KV cache over this many ranks of each tensor "
        "parallel group by token position (each stores and reads 1/N of it); for GQA models whose KV "
        "heads tensor parallel would otherwise replicate (tp a multiple of KV heads x N)", short="-dcp")
    prefill_context_parallel_size: int = knob(
        1, "prefill context parallel: this many groups of tensor parallel ranks, each computing the tokens "
        "whose positions it owns (a long prompt's prefill split N ways) and keeping their KV cache; "
        "attention merges over the groups", short="-pcp")
    dcp_kv_cache_interleave_size: int = knob(
        1, "context parallel: consecutive positions stored on one rank before the next rank's (divides "
        "--block-size)")
    enable_eplb: bool = knob(
        False, "expert parallel load balancing: every step_interval steps, place the experts over the EP ranks "
        "by the tokens each got in the last window_size steps, with redundant copies of the hot ones (needs "
        "--enable-expert-parallel)")
    eplb_config: dict | str | None = knob(
        None, "EPLB as JSON: {\"window_size\": 1000, \"step_interval\": 3000, \"num_redundant_experts\": 0, "
        "\"log_balancedness\": false}")
    eplb: EPLBConfig | None = None        # resolved from the two above (None: EPLB off)

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     "decode_context_parallel_size", "dcp_kv_cache_interleave_size", "prefill_context_parallel_size"):
            size = getattr(self, name)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{name}={size} must be a positive integer.")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"data_parallel_backend={self.data_parallel_backend!r}: use 'mp' or 'ray'.")
        if self.data_parallel_size_local is None:
            self.data_parallel_size_local = self.data_parallel_size - self.data_parallel_start_rank
        if not 0 <= self.data_parallel_start_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_start_rank={self.data_parallel_start_rank} must be within the "
                             f"{self.data_parallel_size} replicas (0..{self.data_parallel_size - 1}).")
        if not 0 <= self.data_parallel_size_local <= self.data_parallel_size - self.data_parallel_start_rank:
            raise ValueError(f"data_parallel_size_local={self.data_parallel_size_local} replicas from start rank "
                             f"{self.data_parallel_start_rank} do not fit in data_parallel_size="
                             f"{self.data_parallel_size}.")
        if self.data_parallel_hybrid_lb:
            self._check_front_end()
        elif self.data_parallel_backend == "ray" and self.distributed_executor_backend != "ray":
            self.data_parallel_size_local = 0                  # Ray places every replica
        elif self.data_parallel_size_local < self.data_parallel_size and not (
                self.data_parallel_address and self.data_parallel_rpc_port):
            raise ValueError(f"{self.data_parallel_size_local} of {self.data_parallel_size} data parallel replicas on "
                             "this node: the others join over the network, so give --data-parallel-address (the "
                             "head's address, reachable from every node) and --data-parallel-rpc-port.")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank, but tensor x pipeline parallel "
                             f"is {self.world_size} ranks: use 'mp' or 'ray' (or leave it out).")
        dcp, tp = self.decode_context_parallel_size, self.tensor_parallel_size
        if tp % dcp:
            divisors = [n for n in range(1, tp + 1) if tp % n == 0]
            raise ValueError(f"decode_context_parallel_size={dcp} must divide tensor_parallel_size={tp}: the "
                             f"KV cache is spread over ranks of each tensor parallel group. With -tp {tp}, -dcp can "
                             f"be {', '.join(map(str, divisors))}.")
        for name in ("distributed_init_timeout", "execute_model_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive seconds.")
        if self.enable_eplb and self.eplb is None:
            self.eplb = EPLBConfig.from_json(self.eplb_config or {})
        elif self.eplb_config and not self.enable_eplb:
            raise ValueError("--eplb-config is given without --enable-eplb: add --enable-eplb (or leave it out).")

    def _check_front_end(self) -> None:
        """--data-parallel-hybrid-lb (or --data-parallel-rank): this server runs its own replicas."""
        if self.data_parallel_size_local < 1:
            raise ValueError("--data-parallel-hybrid-lb: this server serves its own replicas, so give "
                             "--data-parallel-size-local 1 or more (a server without replicas: leave out "
                             "--data-parallel-hybrid-lb).")
        # where the servers of expert parallel replicas meet (engine/dp_front_ends.py): the
        # server of replica 0 listens there; on one node the defaults do
        self.data_parallel_address = self.data_parallel_address or "127.0.0.1"
        self.data_parallel_rpc_port = self.data_parallel_rpc_port or DEFAULT_DP_RPC_PORT

    @property
    def world_size(self) -> int:
        """Ranks of one replica."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.prefill_context_parallel_size

    @property
    def context_parallel_size(self) -> int:
        """Ranks over which each sequence's KV cache is spread (decode x prefill context parallel)."""
        return self.decode_context_parallel_size * self.prefill_context_parallel_size

    def describe_rank(self, rank: int) -> str:
        """A replica rank's place in the grid, for log lines: "rank 5: pp 1, tp 1" (and pcp)."""
        tp, pcp = self.tensor_parallel_size, self.prefill_context_parallel_size
        stage, rest = divmod(rank, tp * pcp)
        where = f"pp {stage}, pcp {rest // tp}, tp {rest % tp}" if pcp > 1 else f"pp {stage}, tp {rest % tp}"
        return f"rank {rank}: {where}"

    @property
    def world_size_across_dp(self) -> int:
        """Ranks of the torch.distributed world this replica's ranks join."""
        return self.world_size * (1 if self.data_parallel_own_world else self.data_parallel_size)

    @property
    def first_world_rank(self) -> int:
        """World rank of this replica's rank 0 in that world."""
        return 0 if self.data_parallel_own_world else self.rank_offset

    @property
    def rank_offset(self) -> int:
        """This replica's rank 0 in the DP x PP x TP grid (its world rank, but in a world of its own)."""
        return self.data_parallel_rank * self.world_size

    @property
    def local_dp_ranks(self) -> range:
        """The replicas this node (or server) runs."""
        return range(self.data_parallel_start_rank, self.data_parallel_start_rank + self.data_parallel_size_local)

    @property
    def local_replica_index(self) -> int:
        """This replica among those on its node (for sharing the node's cores)."""
        return self.data_parallel_rank - self.data_parallel_start_rank

    @property
    def output_rank(self) -> int:
        """The rank that samples and answers the engine core: the first of the last stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size * self.prefill_context_parallel_size


@dataclass
class LoRAConfig:
    """--enable-lora: adapters served beside the base model (shardlm/lora/)."""
    max_loras: int = knob(
        1, "LoRA adapters that can run in one step (each takes a slot in every adapted layer)")
    max_lora_rank: int = knob(
        16, "the largest LoRA rank served; adapters of higher rank are refused")
    max_cpu_loras: int | None = knob(
        None, "LoRA adapters kept read in CPU memory, ready to be swapped into a slot (default: max_loras)")

    def __post_init__(self):
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras}: the "
                             "adapters of a step are kept in CPU memory too.")


@dataclass
class SpeculativeConfig:
    """--speculative-config: propose tokens cheaply, verify them in one target forward pass
    (shardlm/spec_decode/). vLLM's field names."""
    method: str = "ngram"
    num_speculative_tokens: int = 3          # proposed tokens per request per step (k)
    prompt_lookup_min: int | None = None     # ngram: the shortest suffix looked up in the request's tokens
    prompt_lookup_max: int | None = None     # ngram: the longest
    # no proposals in a step whose running batch has this many requests or more (None: the default
    # below; 0: never turned off)
    disable_by_batch_size: int | None = None
    model: str | None = None                 # the draft model or EAGLE head (directory or hub id)
    draft_tensor_parallel_size: int | None = None     # the draft runs whole on the rank that samples: 1
    draft_model_config: ModelConfig | None = None     # resolved by EngineArgs from `model`

    METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
    ALIASES = {"deepseek_mtp": "mtp"}        # vLLM's older name
    WITHOUT_MODEL = ("ngram", "mtp")         # mtp: the target checkpoint's own multi-token-prediction layer
    FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "disable_by_batch_size", "model", "draft_tensor_parallel_size")
    # measured on a 2-core CPU, default model, 62% of proposals accepted (docs/USER_GUIDE.md): ngram
    # gains 1.64x at 4 requests, 1.12x at 16, 1.02x at 32; at lower acceptance, 16 already loses
    DEFAULT_DISABLE_BY_BATCH_SIZE = 16

    @classmethod
    def from_json(cls, value: dict | str) -> SpeculativeConfig:
        """The flag's JSON (or the offline dict), checked; every refusal says what to write."""
        value = json_object_flag(value, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
        unknown = sorted(set(value) - set(cls.FIELDS))
        if unknown:
            raise ValueError(f"--speculative-config has unknown field(s) {unknown}; known: {', '.join(cls.FIELDS)}.")
        if "method" not in value:
            value["method"] = "draft_model" if value.get("model") else "ngram"
        return cls(**value)

    def __post_init__(self):
        self.method = self.ALIASES.get(self.method, self.method)
        if self.method not in self.METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported: use {', '.join(self.METHODS)}.")
        if (self.method in self.WITHOUT_MODEL) == bool(self.model):
            raise ValueError(f"--speculative-config: method {self.method} needs \"model\", the draft model's "
                             "directory or hub id." if not self.model else
                             f"--speculative-config: method {self.method} takes no model; for the draft model "
                             f"{self.model} use method draft_model (or leave method out).")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(f"draft_tensor_parallel_size={self.draft_tensor_parallel_size}: the draft model runs "
                             "whole on the rank that samples in this version; use 1 (or leave it out).")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens={k!r} must be an integer from 1 to 16.")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (lo if lo is not None else hi or 5), (hi if hi is not None else lo or 5)   # vLLM: 5 when neither
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{name}={n!r} must be a positive integer.")
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} is above prompt_lookup_max={hi}: the shortest suffix looked up "
                             "cannot be longer than the longest.")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if self.disable_by_batch_size is None:
            self.disable_by_batch_size = self.DEFAULT_DISABLE_BY_BATCH_SIZE
        n = self.disable_by_batch_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"disable_by_batch_size={n!r} must be a non-negative integer (0: never turned off).")

    def speculates(self, num_running: int) -> bool:
        """Whether a step with this many running requests gets proposals."""
        return not self.disable_by_batch_size or num_running < self.disable_by_batch_size


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: torch.device
    lora: LoRAConfig | None = None           # None: --enable-lora is off
    speculative: SpeculativeConfig | None = None     # None: no speculative decoding

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """What the KV cache stores: the model's dtype, or FP8 (--kv-cache-dtype)."""
        return KV_CACHE_DTYPES[self.cache.kv_cache_dtype] or self.model.dtype

    @property
    def kv_block_tokens(self) -> int:
        """Tokens one KV block id holds: block_size on each rank, times the context parallel
        ranks (dcp x pcp) that each hold their share of its positions. The scheduler, prefix hashes
        and capacity count in these."""
        return self.cache.block_size * self.parallel.context_parallel_size

    @cached_property
    def kv_groups(self) -> KVCacheGroups:
        """How the KV cache is grouped (kv_cache_groups.py): sliding-window layers in groups of
        their own, whose blocks are freed once behind the window; one group where a window never
        frees anything or a feature reads every layer through one table (context parallel's
        shards, a draft model's or EAGLE head's cache)."""
        m = self.model
        spec = self.speculative
        if (self.cache.disable_hybrid_kv_cache_manager or self.parallel.context_parallel_size > 1
                or (spec is not None and spec.method != "ngram")):
            return one_group(m.num_layers)
        return plan_kv_cache_groups([sliding_window(m.hf_config, i) for i in range(m.num_layers)], m.max_model_len)

    @property
    def dp_lockstep(self) -> bool:
        """Data parallel replicas share their MoE layers (expert parallel across DP): every
        replica must run each step's forward together, with a dummy one when it has no work."""
        par = self.parallel
        return par.enable_expert_parallel and par.data_parallel_size > 1 and self.model.num_experts > 0
