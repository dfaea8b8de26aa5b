"""EngineArgs: every user-facing engine knob, with vLLM's names, and their resolution.

`LLM(**kwargs)` and the CLI flags are both generated from EngineArgs. `create_engine_config()`
resolves them, once, in the process the user started: the model path, its config and dtype,
the device, the executor backend; then it runs the start-up checks (can this model be split
this way, does it fit) before any process starts or weight loads. The resolved EngineConfig is
what every other process receives.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

import torch

from shardlm import cpu_plan
from shardlm.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    QuantizationConfig,
    SchedulerConfig,
    SpeculativeConfig,
    json_object_flag,
    parse_size,
)
from shardlm.engine.feature_rules import check_combinations
from shardlm.executor.selection import choose_backend
from shardlm.kv_cache_groups import sliding_window
from shardlm.logger import init_logger
from shardlm.model_loader.default_model import locate_model, resolve_tokenizer_path
from shardlm.model_loader.gptq_awq import checkpoint_method
from shardlm.model_loader.hub import config_dir
from shardlm.models.registry import (
    MODEL_REGISTRY,
    get_model_class,
    is_pooling_architecture,
    language_model_config,
    resolve_architecture,
    text_config_named,
)
from shardlm.multimodal.config import multimodal_config, text_architecture
from shardlm.planner.startup import check_fits, check_parallel_layout
from shardlm.pooling.config import classifier_from_token, resolve_pooler_config, resolve_runner
from shardlm.sampling_params import DEFAULT_MAX_LOGPROBS, GENERATION_CONFIG_FIELDS, LOGPROBS_MODES
from shardlm.worker.cpu_binding import validate_binding

logger = init_logger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


# vLLM's other names for knobs: `LLM(kv_cache_memory_bytes=...)` and `--kv-cache-memory-bytes`
VLLM_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory", "distributed_timeout_seconds": "distributed_init_timeout"}


def knob(default, lands_in: str, help: str, short: str | None = None):
    """A knob that EngineArgs resolves into the model config ("model") or that switches a feature
    ("engine", "lora"): its default, where it lands, its help text and an optional short flag."""
    return field(default=default, metadata={"lands_in": lands_in, "help": help, "short": short})


_LANDS_IN = {CacheConfig: "cache", SchedulerConfig: "scheduler", ParallelConfig: "parallel", LoRAConfig: "lora"}


def knob_of(config: type, name: str, **override):
    """The knob `config.name` as the config declares it (default, help, short flag), landing there
    under the same name; `default=` where EngineArgs resolves it first (the help says how)."""
    declared = next(f for f in fields(config) if f.name == name)
    return field(default=override.get("default", declared.default),
                 metadata={**declared.metadata, "lands_in": _LANDS_IN[config]})


@dataclass
class EngineArgs:
    """Every user-facing engine knob, with vLLM's names: type, default, help, the config it lands
    in (a field of the same name there, unless resolved) and a short flag. A knob of the cache,
    scheduler, parallel or LoRA config is declared there and taken as it is (`knob_of`); the
    others, which are resolved or switch a feature on, are declared here. The CLI flags
    (entrypoints/cli/), `LLM(**kwargs)` and the user guide's table are made from these fields."""

    model: str | None = knob(
        None, "model",
        "Hugging Face model directory (config.json, safetensors, tokenizer), a .gguf file, or a hub "
        "id (org/name, org/name:FILE.gguf); leave out for the embedded default model, "
        "SmolLM2-135M-Instruct")
    tokenizer: str | None = knob(
        None, "model",
        "tokenizer directory, if not the model's")
    hf_config_path: str | None = knob(
        None, "model",
        "the model's config.json from elsewhere, as vLLM's --hf-config-path: a directory, the file, or a hub "
        "id (its config.json alone fetched); architecture, sizes, rope and quantization_config are read from "
        "it, the weights, tokenizer and generation config from the model")
    dtype: str = knob(
        "auto", "model",
        "auto (CUDA: the checkpoint's; CPU: float32 for float32 and float16 checkpoints, and for a "
        "bfloat16 checkpoint bfloat16 unless float32 measures over 1.1x faster at start-up on "
        "decode-sized products of the model's MLP shape, logged with the timings), float32, bfloat16, "
        "float16 (CUDA only)")
    max_model_len: int | None = knob(
        None, "model",
        "longest sequence (prompt + output) in tokens; default: the model's maximum")
    model_impl: str = knob(
        "auto", "model",
        "which code runs the model, as vLLM's: auto (shardlm's own where it has the architecture, else "
        "transformers'), shardlm (or vllm: its own only), transformers (Hugging Face's modeling code with "
        "shardlm's paged KV cache, scheduler and linears; -tp and -pp split it)")
    disable_sliding_window: bool = knob(
        False, "model",
        "as vLLM's: sequences capped at the model's (smallest) attention window, within which every layer "
        "attends to the whole sequence; a model without windows is unchanged")
    seed: int = knob(
        0, "model",
        "random seed for sampling without a per-request seed")
    device: str = knob(
        "auto", "engine",
        "auto, cpu or cuda")
    served_model_name: str | list[str] | None = knob(
        None, "model",
        "the model's name in the server (--served-model-name a b: several, each of which a request may "
        "give; responses repeat the one given, the first where none is); default: the model as given")
    download_dir: str | None = knob(
        None, "model",
        "directory to look for the model in, and the hub cache for hub ids (default: huggingface_hub's, "
        "HF_HOME / HF_HUB_CACHE)")
    revision: str | None = knob(
        None, "model",
        "a hub model's branch, tag or commit (default: main)")
    data_parallel_rank: int | None = knob(
        None, "engine",
        "external load balancing, as vLLM's: this server is replica RANK of --data-parallel-size, with its "
        "own API server, and a load balancer in front spreads the requests (--data-parallel-hybrid-lb with "
        "one local replica from RANK; expert parallel replicas step together across the servers)")
    data_parallel_external_lb: bool = knob(
        False, "engine",
        "accepted for vLLM's command lines: --data-parallel-rank alone makes this server one replica of many")
    disable_custom_all_reduce: bool = knob(
        False, "engine",
        "accepted for vLLM's command lines: shardlm's CUDA all-reduce is NCCL's (gloo's on CPU) in any case")
    hf_token: str | bool | None = knob(
        None, "engine",
        "the Hugging Face token for gated and private hub repos, as vLLM's (set as HF_TOKEN for this process and "
        "the engine's; --hf-token alone: the one `hf auth login` stored, huggingface_hub's default); Ray nodes "
        "take HF_TOKEN from their own environment")
    tokenizer_mode: str = knob(
        "auto", "engine",
        "auto or hf: the repository's Hugging Face tokenizer (vLLM's mistral and other modes need tokenizers "
        "shardlm does not use, and are refused)")
    tokenizer_revision: str | None = knob(
        None, "model",
        "a hub tokenizer's branch, tag or commit (default: main)")
    max_logprobs: int = knob(
        DEFAULT_MAX_LOGPROBS, "model",
        "the most logprobs (top_logprobs, prompt_logprobs) a request may ask for per token, as vLLM's; -1: "
        "the whole vocabulary")
    trust_remote_code: bool = knob(
        False, "model",
        "let transformers run the Python files of the model's repository that define its config and "
        "tokenizer classes (config.json's auto_map), as vLLM's; the model itself always runs shardlm's own "
        "implementation of its architecture")
    load_format: str = knob(
        "auto", "model",
        "auto (or safetensors): the checkpoint's weights; dummy: random weights of the model's shapes, no "
        "checkpoint read (config.json and the tokenizer suffice), to measure the speed and memory of a "
        "model whose weights are not here, as vLLM's")
    generation_config: str = knob(
        "auto", "model",
        "where requests that leave sampling out take their defaults (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens as max_tokens): auto, the model's generation_config.json; vllm, "
        "SamplingParams' own (temperature 1, as vLLM's); or a folder holding a generation_config.json")
    override_generation_config: str | dict | None = knob(
        None, "model",
        "sampling defaults laid over --generation-config's, as JSON, e.g. '{\"temperature\": 0.5}'")
    block_size: int = knob_of(CacheConfig, "block_size")
    kv_cache_memory: int | str = knob_of(CacheConfig, "kv_cache_memory")
    gpu_memory_utilization: float = knob_of(CacheConfig, "gpu_memory_utilization")
    enable_prefix_caching: bool = knob_of(CacheConfig, "enable_prefix_caching")
    kv_cache_dtype: str = knob_of(CacheConfig, "kv_cache_dtype")
    disable_hybrid_kv_cache_manager: bool = knob_of(CacheConfig, "disable_hybrid_kv_cache_manager")
    num_gpu_blocks_override: int | None = knob_of(CacheConfig, "num_gpu_blocks_override")
    max_num_seqs: int = knob_of(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int | None = knob_of(SchedulerConfig, "max_num_batched_tokens", default=None)
    scheduling_policy: str = knob_of(SchedulerConfig, "scheduling_policy")
    enable_chunked_prefill: bool = knob_of(SchedulerConfig, "enable_chunked_prefill")
    long_prefill_token_threshold: int = knob_of(SchedulerConfig, "long_prefill_token_threshold")
    tensor_parallel_size: int = knob_of(ParallelConfig, "tensor_parallel_size")
    pipeline_parallel_size: int = knob_of(ParallelConfig, "pipeline_parallel_size")
    data_parallel_size: int = knob_of(ParallelConfig, "data_parallel_size")
    data_parallel_size_local: int | None = knob_of(ParallelConfig, "data_parallel_size_local")
    data_parallel_start_rank: int = knob_of(ParallelConfig, "data_parallel_start_rank")
    data_parallel_address: str | None = knob_of(ParallelConfig, "data_parallel_address")
    data_parallel_rpc_port: int | None = knob_of(ParallelConfig, "data_parallel_rpc_port")
    data_parallel_backend: str = knob_of(ParallelConfig, "data_parallel_backend")
    data_parallel_hybrid_lb: bool = knob_of(ParallelConfig, "data_parallel_hybrid_lb")
    distributed_executor_backend: str | None = knob_of(ParallelConfig, "distributed_executor_backend")
    distributed_init_timeout: float = knob_of(ParallelConfig, "distributed_init_timeout")
    cpu_threads_bind: str = knob_of(ParallelConfig, "cpu_threads_bind")
    pp_layer_partition: str | None = knob_of(ParallelConfig, "pp_layer_partition")
    allow_cross_node_tp: bool = knob_of(ParallelConfig, "allow_cross_node_tp")
    execute_model_timeout: float = knob_of(ParallelConfig, "execute_model_timeout")
    enable_expert_parallel: bool = knob_of(ParallelConfig, "enable_expert_parallel")
    decode_context_parallel_size: int = knob_of(ParallelConfig, "decode_context_parallel_size")
    prefill_context_parallel_size: int = knob_of(ParallelConfig, "prefill_context_parallel_size")
    dcp_kv_cache_interleave_size: int = knob_of(ParallelConfig, "dcp_kv_cache_interleave_size")
    enable_eplb: bool = knob_of(ParallelConfig, "enable_eplb")
    eplb_config: dict | str | None = knob_of(ParallelConfig, "eplb_config")
    quantization: str | None = knob(
        None, "model",
        "weight-only quantization of the linear layers at load: int8 (one scale per row), int4 "
        "(asymmetric, groups of 128 columns, else 64 or 32 where 128 does not divide), "
        "fp8_per_channel (alias fp8), fp8_per_tensor or fp8_per_block (e4m3, blocks of 128 x 128); "
        "int8, int4 and fp8_* quantize MoE experts too; embeddings, LM head and routers stay in --dtype. Faster "
        "only with --dtype bfloat16. "
        "gguf: a .gguf model's own Q8_0/Q4_0/Q4_1 and Q4_K/Q5_K/Q6_K blocks; GPTQ and AWQ "
        "checkpoints (4-bit), compressed-tensors ones (integer W4A16, W8A16, W8A8, and FP8) and FP8 "
        "ones (fp8, fbgemm_fp8) are detected from config.json and run as stored")
    quantization_group_size: int | None = knob(
        None, "model",
        "input columns per quantization scale (-1: one per row; default: int8 -1, int4 128)")
    cpu_plan: str | None = knob(
        None, "model",
        "CPU: a JSON file of the CPU path's choices (kernel rows per weight, bfloat16 dot product, AMX "
        "rows, --dtype auto): where it exists its choices are taken without timing anything (a run repeated exactly, a "
        "machine pinned); where it does not, this run writes its plan there")
    enforce_eager: bool = knob(
        False, "model",
        "run every step layer by layer: no CUDA graphs on a GPU, no one-call C decode path on "
        "CPU; the same results, slower")
    batch_invariant: bool = knob(
        True, "model",
        "CPU: every product sums a row in the same order whatever the rows it is computed with, so a "
        "request's outputs do not depend on the batch it is in (bfloat16 products on the AMX tiles of "
        "Xeons at every row count, where one row there is as fast as on the vector kernels); "
        "--no-batch-invariant runs bfloat16 products of many rows (prefill, large batches) on the AMX "
        "tiles (about 2x faster prefill), few rows on the vector kernels")
    structured_outputs_config: dict | str | None = knob(
        None, "model",
        "structured outputs, as JSON: {\"backend\": \"auto\"} (auto or guidance: llguidance), "
        "\"reasoning_parser\" as --reasoning-parser")
    enable_lora: bool = knob(
        False, "engine",
        "serve LoRA adapters (PEFT format) beside the base model: requests name one with "
        "lora_request offline, or by model name in the server (--lora-modules)")
    max_loras: int = knob_of(LoRAConfig, "max_loras")
    max_lora_rank: int = knob_of(LoRAConfig, "max_lora_rank")
    max_cpu_loras: int | None = knob_of(LoRAConfig, "max_cpu_loras")
    speculative_config: dict | str | None = knob(
        None, "engine",
        "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
        "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5} proposes the tokens that followed the last "
        "n-gram's previous occurrence in the prompt or output; \"disable_by_batch_size\": N turns it off "
        "in steps with N or more running requests (default 16; 0: never); {\"model\": DIR, ...} a "
        "draft model of the same tokenizer; {\"method\": \"eagle\" or \"eagle3\", \"model\": DIR, ...} "
        "an EAGLE head; {\"method\": \"mtp\"} DeepSeek-V3's own multi-token-prediction layer")
    collect_detailed_traces: str | None = knob(
        None, "model",
        "with the server's --otlp-traces-endpoint: time each step on the engine core and the workers and add "
        "each request's share to its span (gen_ai.latency.time_in_model_execute / time_in_model_forward); "
        "model, worker or all (vLLM's names; each records both here)")
    disable_log_stats: bool = knob(
        False, "model",
        "no periodic log line of throughput, queue and KV cache use (the server's /metrics still count)")
    enable_log_requests: bool = knob(
        False, "model",
        "log each request as it arrives: its id, prompt, sampling parameters and adapter (the server and "
        "AsyncLLM; --max-log-len shortens the prompt)")
    max_log_len: int | None = knob(
        None, "model",
        "with --enable-log-requests: at most this many characters and token ids of each prompt (default: all)")
    enable_log_outputs: bool = knob(
        False, "model",
        "with --enable-log-requests: log each request's outputs as it finishes (text, token ids, finish reason)")
    enable_sleep_mode: bool = knob(
        False, "model",
        "as vLLM's: LLM.sleep(level) / wake_up() and the server's POST /sleep?level=1|2, POST /wake_up and GET "
        "/is_sleeping give back the KV cache's memory (level 1) and the weights' (level 2, read again from the "
        "checkpoint at wake-up) while the engine idles, e.g. during an RL trainer's turn")
    skip_tokenizer_init: bool = knob(
        False, "model",
        "load no tokenizer, as vLLM's: prompts as token ids, outputs as token ids (their text empty), no stop "
        "strings, structured outputs or chat; the server's logprobs name tokens token_id:N")
    limit_mm_per_prompt: dict | str | None = knob(
        None, "model",
        "vision-language models: the most images a prompt may carry, as a JSON object, as vLLM's "
        "(e.g. '{\"image\": 2}'; default 999)")
    enable_prompt_embeds: bool = knob(
        False, "model",
        "prompts may be given as embeddings, as vLLM's: LLM.generate({\"prompt_embeds\": tensor [tokens, "
        "hidden]}) and /v1/completions' prompt_embeds (base64 of torch.save), for Llama-family models")
    mm_processor_kwargs: dict | str | None = knob(
        None, "model",
        "vision-language models: options for the checkpoint's Hugging Face processor, as a JSON object, as vLLM's "
        "(e.g. Idefics3's '{\"do_image_splitting\": false}'); a prompt dict's mm_processor_kwargs override them")
    allowed_media_domains: list[str] | None = knob(
        None, "model",
        "vision-language models: http(s) image URLs are fetched only from these hosts, as vLLM's (default: any host)")
    allowed_local_media_path: str | None = knob(
        None, "model",
        "vision-language models: file: image URLs are read from under this directory (else refused), as vLLM's")
    logprobs_mode: str = knob(
        "raw_logprobs", "model",
        "what logprobs and prompt_logprobs report, as vLLM's: raw_logprobs (the model's), raw_logits, or "
        "processed_logprobs / processed_logits, after constraints, biases, penalties, temperature and "
        "top-k/top-p/min-p (what the token was drawn from; prompt positions stay raw)")
    logits_processors: list[str] | list[type] | None = knob(
        None, "model",
        "custom logits processors, as vLLM's: classes with vLLM v1's interface (shardlm.logits_processor."
        "LogitsProcessor), named 'package.module:Class' (LLM() also takes the classes); requests opt in "
        "through SamplingParams.extra_args (the server's vllm_xargs). Installed ones of the entry-point "
        "group shardlm.logits_processors load too")
    stream_interval: int = knob(
        1, "model",
        "streams send new tokens once this many have come (the first and the last at once), as vLLM's: fewer, "
        "larger chunks for less overhead at high throughput")
    hf_overrides: dict | str | None = knob(
        None, "model",
        "JSON set over the checkpoint's config.json before anything reads it, as vLLM's: e.g. "
        "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", "
        "\"yes\"]}' serves Qwen3-Reranker (a causal LM) as a cross-encoder scoring yes against no")
    runner: str = knob(
        "auto", "model",
        "generate, or pooling (embeddings, classes, scores and rerank: /v1/embeddings, /classify, /score, "
        "/rerank; LLM.embed, classify, score, encode); auto: pooling for the architectures that only pool "
        "(BertModel, XLMRobertaModel, ...ForSequenceClassification), generate for the rest")
    convert: str = knob(
        "auto", "model",
        "run a generative checkpoint as a pooling model: embed (its last token's hidden state, e.g. "
        "Qwen3-Embedding) or classify (its `score` matrix); auto: embed with --runner pooling; none")
    pooler_config: dict | str | None = knob(
        None, "model",
        "the pooling runner's pooling, as JSON over the checkpoint's sentence-transformers files and the "
        "model's defaults: {\"pooling_type\": \"MEAN\"} (CLS, LAST, MEAN, ALL, STEP), \"normalize\": "
        "bool (embeddings to unit length), \"use_activation\": bool (sigmoid / softmax over classes), "
        "\"step_tag_id\": int (STEP: the token whose positions are returned)")
    reasoning_parser: str | None = knob(
        None, "model",
        "how this reasoning model marks its thinking: deepseek_r1, qwen3 or deepseek_v3 (DeepSeek-V3.1) "
        "(<think>...</think>); the server returns it as reasoning_content, and structured outputs constrain "
        "only the answer (at once where the prompt closes the thinking)")
    reasoning_parser_plugin: str | None = knob(
        None, "model",
        "a Python file that registers reasoning parsers (shardlm.reasoning.register_reasoning_parser), as "
        "vLLM's: its names then work with --reasoning-parser")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def landing_in(self, config: str) -> dict:
        """The knobs that land in `config` as they were given, by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["lands_in"] == config}

    def create_engine_config(self) -> EngineConfig:
        """Resolve every knob and check the layout and memory; raises ValueError with what to do."""
        if isinstance(self.hf_token, str) and self.hf_token:
            os.environ["HF_TOKEN"] = self.hf_token      # huggingface_hub's, here and in the processes started later
        if self.tokenizer_mode not in ("auto", "hf"):
            raise ValueError(f"--tokenizer-mode {self.tokenizer_mode!r}: shardlm uses the repository's Hugging Face "
                             "tokenizer files; give auto or hf.")
        parallel = ParallelConfig(**{**self.landing_in("parallel"),
                                     "pp_layer_partition": _parse_partition(self.pp_layer_partition)})
        if self.data_parallel_rank is not None:
            parallel = _one_replica_of_many(parallel, self.data_parallel_rank)
        # on Ray a core list is per node (checked when the ranks are placed)
        validate_binding(parallel.cpu_threads_bind, None if parallel.distributed_executor_backend == "ray"
                         else parallel.data_parallel_size_local * parallel.world_size)
        device = resolve_device(self.device)
        cpu_plan.follow(self.cpu_plan)
        parallel.distributed_executor_backend = choose_backend(parallel.world_size, device,
                                                               parallel.distributed_executor_backend)
        # found once (a hub id fetched, a GGUF file converted); what follows reads the local directory
        source = locate_model(self.model, self.revision, self.download_dir)
        path = source.path
        checkpoint_config = load_hf_config(path if self.hf_config_path is None else
                                           config_dir(self.hf_config_path, self.revision, self.download_dir),
                                           self.trust_remote_code)
        if self.hf_overrides:
            for key, value in json_object_flag(self.hf_overrides, "--hf-overrides",
                                               '{"architectures": ["Qwen3ForSequenceClassification"]}').items():
                setattr(checkpoint_config, key, value)
        multimodal = multimodal_config(checkpoint_config, self.limit_mm_per_prompt, self.allowed_local_media_path,
                                       self.mm_processor_kwargs, self.allowed_media_domains)
        if multimodal is not None:      # a vision-language checkpoint: its text model, its images beside
            architecture, model_impl = _text_model_of(multimodal, self.model_impl)
            hf_config = text_config_named(checkpoint_config, architecture)
        else:
            architecture, model_impl = resolve_architecture(checkpoint_config, self.model_impl)
            if model_impl == "transformers":
                logger.info("%s runs on the Transformers backend: transformers' modeling code with shardlm's KV "
                            "cache, scheduler and linear layers (--model-impl)", architecture)
            hf_config = language_model_config(checkpoint_config, architecture)    # a multimodal one's text model
        dtype = resolve_dtype(self.dtype, _config_dtype(checkpoint_config), device, _mlp_shape(hf_config))
        runner, convert = resolve_runner(architecture, self.runner, self.convert,
                                         is_pooling_architecture(architecture))
        pooler = None
        if runner == "pooling":
            if getattr(hf_config, "classifier_from_token", None):
                classifier_from_token(hf_config, self.tokenizer or path, self.trust_remote_code)
            pooler = resolve_pooler_config(path, hf_config, get_model_class(architecture, convert, model_impl),
                                           self.pooler_config)
            max_model_len = _pooling_max_model_len(hf_config, pooler, self.max_model_len)
        else:
            if self.pooler_config:
                raise ValueError("--pooler-config applies to pooling models: add --runner pooling.")
            max_model_len = _resolve_max_model_len(hf_config, self.max_model_len)
            if self.disable_sliding_window:
                max_model_len = _within_the_window(hf_config, max_model_len, self.max_model_len)
        served_names = _served_names(self.served_model_name, self.model or "SmolLM2-135M-Instruct")
        checkpoint = checkpoint_method(getattr(hf_config, "quantization_config", None))
        gen_defaults = load_generation_defaults(path)        # (its EOS ids count whatever the sampling defaults)
        sampling_defaults = resolve_sampling_defaults(self.generation_config, self.override_generation_config,
                                                      gen_defaults)
        model_cfg = ModelConfig(
            model=path, tokenizer=resolve_tokenizer_path(self.tokenizer, self.download_dir, self.tokenizer_revision)
            if self.tokenizer else path, hf_config=hf_config, dtype=dtype,
            max_model_len=max_model_len, seed=self.seed, architecture=architecture, model_impl=model_impl,
            served_model_name=served_names[0], served_model_names=served_names,
            eos_token_ids=_eos_ids(checkpoint_config, gen_defaults), generation_defaults=sampling_defaults,
            quantization=resolve_quantization(
                self.quantization, self.quantization_group_size,
                linear_inputs(hf_config, parallel.tensor_parallel_size) if self.quantization else None,
                gguf_source=source.gguf_file,
                checkpoint=checkpoint),
            enforce_eager=self.enforce_eager, batch_invariant=self.batch_invariant, cpu_plan=self.cpu_plan,
            hub_source=source.hub,
            download_dir=self.download_dir,
            reasoning_parser=_reasoning_parser(self.structured_outputs_config, self.reasoning_parser,
                                               self.reasoning_parser_plugin),
            reasoning_parser_plugin=self.reasoning_parser_plugin,
            runner=runner, convert=convert, pooler=pooler, collect_detailed_traces=_detailed_traces(
                self.collect_detailed_traces), disable_log_stats=self.disable_log_stats,
            enable_log_requests=self.enable_log_requests, max_log_len=self.max_log_len,
            enable_log_outputs=self.enable_log_outputs, stream_interval=self.stream_interval,
            logprobs_mode=_logprobs_mode(self.logprobs_mode),
            logits_processors=_logits_processors(self.logits_processors), skip_tokenizer_init=self.skip_tokenizer_init,
            enable_sleep_mode=self.enable_sleep_mode,
            max_logprobs=_max_logprobs(self.max_logprobs),
            trust_remote_code=self.trust_remote_code, multimodal=multimodal,
            enable_prompt_embeds=_prompt_embeds(self.enable_prompt_embeds, architecture),
            load_format=_load_format(self.load_format, source.gguf_file, checkpoint))
        cache = CacheConfig(**{**self.landing_in("cache"), "kv_cache_memory": parse_size(self.kv_cache_memory)})
        batched_tokens = self.max_num_batched_tokens or max(SchedulerConfig.max_num_batched_tokens, self.max_num_seqs)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens is None:
            batched_tokens = max(batched_tokens, max_model_len)     # a whole prompt fits a step
        if pooler is not None:
            # a pooled prompt is computed whole in one step; its KV cache is not kept for later prompts
            cache.enable_prefix_caching = False
            batched_tokens = max(batched_tokens, max_model_len)
        scheduler = SchedulerConfig(**{**self.landing_in("scheduler"), "max_model_len": max_model_len,
                                       "max_num_batched_tokens": batched_tokens})
        lora = LoRAConfig(**self.landing_in("lora")) if self.enable_lora else None
        speculative = SpeculativeConfig.from_json(self.speculative_config) if self.speculative_config else None
        if speculative is not None and speculative.model:
            speculative.draft_model_config = self._draft_model_config(speculative, model_cfg)
        if speculative is not None and speculative.method == "mtp":
            speculative.draft_model_config = _mtp_config(model_cfg)
        config = EngineConfig(model_cfg, cache, scheduler, parallel, device, lora, speculative)
        if parallel.data_parallel_hybrid_lb:
            config.parallel = _own_replicas_alone(parallel, config.dp_lockstep)
        check_combinations(config)
        check_parallel_layout(config)
        check_fits(config)   # before any weights are loaded
        return config


    def _draft_model_config(self, spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
        """The draft model's (or EAGLE head's) config: a model of the target's tokenizer (checked:
        the same vocabulary) that covers max_model_len, in the target's dtype, unquantized; an
        EAGLE head reads the target's hidden states, so it has the target's hidden size."""
        draft = spec.model
        source = locate_model(draft, None, self.download_dir)
        path = source.path
        hf_config = load_hf_config(path, self.trust_remote_code)
        if spec.method in ("eagle", "eagle3") and hf_config.hidden_size != target.hf_config.hidden_size:
            raise ValueError(f"The EAGLE head {draft} has hidden size {hf_config.hidden_size}, the target "
                             f"{target.hf_config.hidden_size}: an EAGLE head must be made for this target model.")
        if spec.method == "eagle3":
            from shardlm.models.eagle3 import aux_layers_of
            from shardlm.models.registry import get_model_class
            if not getattr(get_model_class(target.architecture), "eagle3_target", True):
                raise ValueError(f"An EAGLE-3 head reads the inputs of a Llama-family decoder's layers, which "
                                 f"{target.architecture} does not have: use method eagle, draft_model or ngram.")
            aux = aux_layers_of(hf_config, target.num_layers)
            if not all(0 <= i < target.num_layers for i in aux):
                raise ValueError(f"The EAGLE-3 head {draft} reads the target's layers {list(aux)}, but the target has "
                                 f"{target.num_layers} layers (0 to {target.num_layers - 1} can be read).")
        if hf_config.vocab_size != target.vocab_size:
            raise ValueError(f"The draft model {draft} has a vocabulary of {hf_config.vocab_size} tokens, the target "
                             f"{target.vocab_size}: a draft model must use the target's tokenizer (e.g. a smaller "
                             "model of the same family).")
        limit = _resolve_max_model_len(hf_config, None)
        if limit < target.max_model_len:
            raise ValueError(f"The draft model {draft} covers {limit} positions, fewer than max_model_len="
                             f"{target.max_model_len}: lower --max-model-len to at most {limit}.")
        # a draft model runs on shardlm's own code where it has the architecture, else on transformers'
        architecture, model_impl = resolve_architecture(hf_config, "shardlm" if spec.method != "draft_model"
                                                        else "auto")
        return dataclasses.replace(target, model=path, hf_config=hf_config, architecture=architecture,
                                   model_impl=model_impl, quantization=None, hub_source=source.hub)


def _mtp_config(target: ModelConfig) -> ModelConfig:
    """Method mtp: the target's own multi-token-prediction layer (DeepSeek-V3's num_nextn_predict_layers)."""
    from shardlm.models.deepseek_mtp import mtp_layers
    if mtp_layers(target) == 0:
        raise ValueError(f"Speculative method mtp needs a model with multi-token-prediction layers (DeepSeek-V3: "
                         f"num_nextn_predict_layers); {target.architecture} has none. Use ngram, draft_model or eagle.")
    return target


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported: use 'auto', 'cpu' or 'cuda'.")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device "
                         f"(torch {torch.__version__}). Use device='cpu' or install a CUDA build of torch.")
    return torch.device(device)


# --dtype auto keeps a bfloat16 checkpoint in bfloat16 on CPU unless float32 measures this much faster
FLOAT32_MARGIN = 1.1


def resolve_dtype(dtype: str | torch.dtype, config_dtype: torch.dtype | None, device: torch.device,
                  mlp_shape: tuple[int, int] | None = None, measurement=None) -> torch.dtype:
    """'auto': the checkpoint's dtype on CUDA. On CPU, float32 for float32 and float16 checkpoints
    (float16 runs on CUDA only; bfloat16 would lose mantissa bits); for a bfloat16 checkpoint,
    whichever of bfloat16 and float32 the kernels run faster on this CPU, measured on a product
    of the model's MLP shape (mlp_shape: hidden, intermediate; layers/cpu_dtype.py). An explicit
    dtype is obeyed."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        resolved = config_dtype or torch.float32
        if device.type == "cpu" and resolved == torch.float16:
            logger.info("--dtype auto: float32 for this float16 checkpoint: float16 runs on CUDA only.")
            resolved = torch.float32
        elif device.type == "cpu" and resolved == torch.bfloat16:
            resolved = _faster_cpu_dtype(mlp_shape, measurement)
    elif dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype={dtype!r} is not supported: use auto, float32, bfloat16 or float16.")
    if resolved == torch.float16 and device.type == "cpu":
        raise ValueError("dtype float16 is supported on CUDA only; on CPU use bfloat16 or float32.")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {resolved} is not supported: use float32, bfloat16 or float16.")
    return resolved


def linear_inputs(hf_config, tp: int) -> list[int]:
    """Input columns per rank of the linears that quantization compresses."""
    from shardlm.planner.model_shape import ModelShape
    return list(ModelShape.from_config("model", hf_config.to_dict()).linear_inputs_per_rank(tp).values())


def resolve_quantization(method: str | None, group_size: int | None, inputs: list[int] | None = None,
                         gguf_source: str | None = None,
                         checkpoint: QuantizationConfig | None = None) -> QuantizationConfig | None:
    """int4's default group: 128 columns, or 64 or 32 where 128 does not divide every layer's inputs
    per rank (`inputs`; e.g. SmolLM2's 576). gguf: the linears as the GGUF file stores them.
    checkpoint: a GPTQ/AWQ/FP8/compressed-tensors checkpoint's (checkpoint_method), which is what
    runs (as vLLM, it needs no flag). fp8 on a float checkpoint: fp8_per_channel (vLLM's alias)."""
    from shardlm.layers.fp8 import ALIASES, BLOCK, SCHEMES
    from shardlm.layers.quantization import DEFAULT_GROUP_SIZE
    from shardlm.model_loader.gguf_weights import GROUP
    if checkpoint is not None and checkpoint.method == "fp8" and method in SCHEMES:
        raise ValueError(f"This checkpoint is already FP8 and runs as it is stored: leave out --quantization {method} "
                         "(online FP8 quantizes a float checkpoint).")
    if checkpoint is not None:
        stored, group = checkpoint.method, checkpoint.group_size
        if method not in (None, stored) or group_size not in (None, group):
            groups = "one scale a row" if group == -1 else f"groups of {group} columns"
            raise ValueError(f"This checkpoint is {stored.upper()}-quantized ({groups}) and runs as it is stored: "
                             f"leave out --quantization (or pass --quantization {stored}) and "
                             "--quantization-group-size.")
        return checkpoint
    if method in ("gptq", "awq", "compressed-tensors"):
        raise ValueError(f"--quantization {method} reads a {method.upper()} checkpoint, but this model's config.json "
                         "has no quantization_config for it. For a float checkpoint use --quantization int8 or int4.")
    if method == "gguf":
        if gguf_source is None:
            raise ValueError("--quantization gguf reads the linears from the model's GGUF file: give a .gguf file "
                             "as the model (or leave it out for the embedded default model). Hugging Face "
                             "directories: --quantization int8 or int4.")
        if group_size not in (None, GROUP):
            raise ValueError(f"--quantization gguf has groups of {GROUP} columns, as the file stores them.")
        return QuantizationConfig("gguf", GROUP, gguf_source)
    if method is None:
        if group_size is not None:
            raise ValueError("quantization_group_size is given without a quantization method: add --quantization "
                             "int8 or int4.")
        return None
    method = ALIASES.get(method, method)
    if method in SCHEMES:
        if group_size is not None:
            raise ValueError(f"--quantization {method} sets its own scales (per output channel, per tensor, or per "
                             "block of 128 x 128): leave out --quantization-group-size.")
        return QuantizationConfig(method, BLOCK if method == "fp8_per_block" else -1)
    if method not in DEFAULT_GROUP_SIZE:
        raise ValueError(f"quantization={method!r} is not supported: use int8, int4, fp8_per_channel (fp8), "
                         "fp8_per_tensor or fp8_per_block (weight-only, quantized at load), gguf (a GGUF file's own "
                         "blocks), or gptq / awq / fp8 (read from such a checkpoint; detected without the flag).")
    group = group_size
    if group is None:
        group = DEFAULT_GROUP_SIZE[method]
        if group > 0 and inputs:
            group = next((g for g in (group, 64, 32) if all(n % g == 0 for n in inputs)), group)
    if group != -1 and (group < 2 or group % 2):
        raise ValueError(f"quantization_group_size={group_size}: use -1 (one group per row) or an even number of "
                         "columns such as 32, 64 or 128.")
    return QuantizationConfig(method, group)


def _prompt_embeds(enabled: bool, architecture: str) -> bool:
    if enabled and not getattr(MODEL_REGISTRY.get(architecture), "takes_embeddings", False):
        raise ValueError(f"--enable-prompt-embeds: {architecture} does not take embeddings in place of tokens here "
                         "(Llama-family models do: Llama, Mistral, Qwen2/3, Granite, SmolLM3, Phi-3, ...).")
    return enabled


def _text_model_of(multimodal, model_impl: str) -> tuple[str, str]:
    """A vision-language checkpoint's text architecture, which must be shardlm's own model (it
    takes the images' embeddings in place of their placeholders' token embeddings)."""
    architecture = text_architecture(multimodal.hf_config)
    if model_impl == "transformers":
        raise ValueError(f"{multimodal.architecture} runs its text model on shardlm's own code: leave out "
                         "--model-impl transformers.")
    if not getattr(MODEL_REGISTRY.get(architecture), "takes_embeddings", False):
        raise ValueError(f"{multimodal.architecture}'s text model {architecture} cannot take images here: its text "
                         "models run on shardlm's Llama-family code (Llama, Mistral, Qwen2, ...).")
    logger.info("%s: its %s text model, and images through its vision tower (transformers' modules)",
                multimodal.architecture, architecture)
    return architecture, "shardlm"


def _parse_partition(text: str | list[int] | None) -> list[int] | None:
    if text is None or isinstance(text, list):
        return text
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"pp_layer_partition={text!r}: write the layers of each stage separated by commas, "
                         "e.g. 16,14.") from None


def load_hf_config(path: str, trust_remote_code: bool = False):
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path} has no config.json: pass a Hugging Face model directory "
                         "(config.json, *.safetensors, tokenizer files).")
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        raise ValueError(f"{path}: its config class is defined by Python files of the model's own (config.json's "
                         "auto_map): pass --trust-remote-code (LLM(..., trust_remote_code=True)) to let "
                         "transformers run them.") from None


def load_generation_defaults(path: str) -> dict:
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_path):
        return {}
    with open(gen_path) as f:
        return json.load(f)


def _served_names(given: str | list[str] | None, model: str) -> list[str]:
    names = [given] if isinstance(given, str) else list(given or [model])
    if not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"--served-model-name {given!r}: give one or more non-empty names.")
    return names


def _max_logprobs(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"--max-logprobs {value}: give a count >= 0, or -1 for the whole vocabulary.")
    return value


def _logits_processors(given) -> list:
    """The given processors, each checked to import as a LogitsProcessor (a clear error before any
    process starts)."""
    from shardlm.logits_processor import load_logits_processors
    given = [given] if isinstance(given, (str, type)) else list(given or [])
    load_logits_processors(given)
    return given


def _logprobs_mode(mode: str) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"--logprobs-mode {mode!r}: give {', '.join(LOGPROBS_MODES)}.")
    return mode


def _load_format(choice: str, gguf_file: str | None, checkpoint: QuantizationConfig | None) -> str:
    if choice == "safetensors":
        choice = "auto"
    if choice not in ("auto", "dummy"):
        raise ValueError(f"--load-format {choice}: give auto (the checkpoint's weights) or dummy (random weights).")
    # an FP8 checkpoint's weights are float once read (fp8.py), so random ones stand in for them too
    packed = "GGUF" if gguf_file else checkpoint.method.upper() if checkpoint and checkpoint.method != "fp8" else None
    if choice == "dummy" and packed:
        raise ValueError(f"--load-format dummy makes float weights, not {packed} blocks: give a float model "
                         "(--quantization int8 or int4 quantizes its weights at load).")
    return choice


def resolve_sampling_defaults(choice: str, override: str | dict | None, model_file: dict) -> dict:
    """vLLM's --generation-config (auto: the model's generation_config.json; vllm: none; else a
    folder holding one) with --override-generation-config (JSON) laid over it."""
    if choice == "auto":
        defaults = dict(model_file)
    elif choice == "vllm":
        defaults = {}
    elif os.path.isdir(choice):
        defaults = load_generation_defaults(choice)
        if not defaults:
            raise ValueError(f"--generation-config {choice}: the folder has no generation_config.json.")
    else:
        raise ValueError(f"--generation-config {choice!r}: give auto (the model's generation_config.json), vllm "
                         "(none) or a folder holding a generation_config.json.")
    override = json_object_flag(override, "--override-generation-config", '{"temperature": 0.5}')
    known = {*GENERATION_CONFIG_FIELDS, "do_sample"}
    if unknown := sorted(set(override) - known):
        raise ValueError(f"--override-generation-config: {', '.join(unknown)} gives no sampling default; use "
                         f"{', '.join(sorted(known))}.")
    return {**defaults, **override}


def _faster_cpu_dtype(mlp_shape: tuple[int, int] | None, measurement) -> torch.dtype:
    """A CPU plan's choice (cpu_plan.py): measured here unless --cpu-plan gives it (or the caller
    hands a measurement in)."""
    from shardlm.layers import cpu_dtype
    shape = mlp_shape or (2048, 8192)
    if measurement is not None:
        return _DTYPES[_dtype_from(measurement)[0]]
    return _DTYPES[cpu_plan.choose("dtype_auto", f"MLP [{shape[0]}, {shape[1]}]",
                                   lambda: _dtype_from(cpu_dtype.measure(*shape)))]


def _dtype_from(measurement) -> tuple[str, str]:
    """(the faster dtype's name, what was measured), logged."""
    speedup = measurement.bfloat16_speedup()
    chosen = "bfloat16" if speedup * FLOAT32_MARGIN >= 1 else "float32"
    how = (f"bfloat16 decode-sized products take {1 / speedup:.2f}x float32's time ({measurement.describe()}; ISA "
           f"variant {_isa()})")
    logger.info("--dtype auto: %s for this bfloat16 checkpoint: on this CPU %s. --dtype float32 or bfloat16 "
                "overrides.", chosen, how)
    return chosen, how


def _isa() -> str:
    from shardlm import kernels
    return kernels.active_isa() if kernels.library() is not None else "none: torch ops"


def _mlp_shape(hf_config) -> tuple[int, int] | None:
    """(hidden, intermediate) of the model's MLP, the product measured for --dtype auto."""
    text = getattr(hf_config, "text_config", hf_config)
    hidden = getattr(text, "hidden_size", None)
    inter = getattr(text, "intermediate_size", None) or getattr(text, "moe_intermediate_size", None)
    return (hidden, inter) if hidden and inter else None


def _reasoning_parser(config: dict | str | None, reasoning_parser: str | None, plugin: str | None = None) -> str | None:
    """--structured-outputs-config (vLLM's: backend, reasoning_parser) and --reasoning-parser, checked
    -> the reasoning parser (the backend is llguidance whichever of its names is given)."""
    from shardlm.reasoning import get_reasoning_parser
    from shardlm.structured_output.grammar import BACKENDS
    config = json_object_flag(config, "--structured-outputs-config", '{"backend": "auto"}')
    unknown = sorted(set(config) - {"backend", "reasoning_parser"})
    if unknown:
        raise ValueError(f"--structured-outputs-config has unknown key(s) {', '.join(unknown)}: it takes backend and "
                         "reasoning_parser.")
    backend = config.get("backend") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"Structured-output backend {backend!r} is not available: use {' or '.join(BACKENDS)} "
                         "(llguidance).")
    parser = reasoning_parser or config.get("reasoning_parser")
    if parser is not None:
        get_reasoning_parser(parser, plugin)          # a ValueError naming the ones there are
    return parser


def _config_dtype(hf_config) -> torch.dtype | None:
    dt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dt, str):
        return _DTYPES.get(dt)
    return dt if isinstance(dt, torch.dtype) else None


def _eos_ids(hf_config, gen_defaults: dict) -> list[int]:
    eos = gen_defaults.get("eos_token_id", getattr(hf_config, "eos_token_id", None))
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def _detailed_traces(value: str | None) -> bool:
    if value is None:
        return False
    if value not in ("model", "worker", "all"):
        raise ValueError(f"--collect-detailed-traces {value!r}: use model, worker or all.")
    return True


def _pooling_max_model_len(hf_config, pooler, requested: int | None) -> int:
    """An encoder covers its position table (less RoBERTa's offset); a sentence-transformers
    checkpoint's max_seq_length is the default, as sentence-transformers itself uses it."""
    from shardlm.pooling.bert import encoder_max_positions
    is_encoder = getattr(hf_config, "model_type", "") in ("bert", "roberta", "xlm-roberta")
    limit = encoder_max_positions(hf_config) if is_encoder else _resolve_max_model_len(hf_config, None)
    if requested is None:
        return min(limit, pooler.max_seq_length or limit)
    return _resolve_max_model_len(SimpleNamespace(max_position_embeddings=limit), requested)


def _one_replica_of_many(parallel: ParallelConfig, rank: int) -> ParallelConfig:
    """--data-parallel-rank: this server runs that one replica, behind its own API server (hybrid
    load balancing with one replica a server)."""
    size = parallel.data_parallel_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"--data-parallel-rank {rank!r}: give a replica in [0, {size}) (--data-parallel-size {size}).")
    return dataclasses.replace(parallel, data_parallel_size_local=1, data_parallel_start_rank=rank,
                               data_parallel_hybrid_lb=True)


def _own_replicas_alone(parallel: ParallelConfig, lockstep: bool) -> ParallelConfig:
    """A server of hybrid or external load balancing (engine/dp_front_ends.py). Replicas that do not
    step together never meet: this server's run as a -dp of their own. Expert parallel ones keep
    their place in the whole deployment's DP world."""
    first, count = parallel.data_parallel_start_rank, parallel.data_parallel_size_local
    ranks = f"replica {first}" if count == 1 else f"replicas {first}-{first + count - 1}"
    logger.info("%s load balancing: this server serves %s of %d%s", "External" if count == 1 else "Hybrid", ranks,
                parallel.data_parallel_size, ", stepping together with the other servers' (expert parallel)"
                if lockstep else ", on its own" if count == 1 else ", on their own")
    if lockstep:
        return parallel
    return dataclasses.replace(parallel, data_parallel_size=count, data_parallel_size_local=count,
                               data_parallel_start_rank=0, data_parallel_hybrid_lb=False)


def _within_the_window(hf_config, max_model_len: int, requested: int | None) -> int:
    """--disable-sliding-window, as vLLM's: sequences no longer than the smallest window, where
    windowed attention attends to everything before, as full attention does (unchanged for a
    model without windows)."""
    windows = {sliding_window(hf_config, i) for i in range(hf_config.num_hidden_layers)} - {None}
    if not windows or max_model_len <= min(windows):
        return max_model_len
    if requested is not None:
        raise ValueError(f"max_model_len={requested} is longer than the model's attention window ({min(windows)}), "
                         "to which --disable-sliding-window caps sequences: give at most that, or leave out "
                         "--disable-sliding-window.")
    logger.info("max_model_len %d: the attention window (--disable-sliding-window)", min(windows))
    return min(windows)


def _resolve_max_model_len(hf_config, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is None:
        return limit
    if requested <= 0:
        raise ValueError(f"max_model_len={requested} must be positive.")
    if requested > limit:
        raise ValueError(f"max_model_len={requested} is longer than the model's "
                         f"max_position_embeddings={limit}; use max_model_len <= {limit}.")
    return requested
