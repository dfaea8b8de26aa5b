"""`shardlm plan`: will a model fit, and how to split it (from config.json, nothing loaded)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("plan", help="will a model fit, and how to split it: from config.json, nothing loaded")
    p.add_argument("model", help="model directory, config.json, GGUF file, or a preset: Llama-3.1-8B, Llama-3.1-70B, "
                   "Llama-3.1-405B, Llama-3.1-405B-FP8, Mixtral-8x7B, Qwen2.5-7B, Qwen2.5-72B, DeepSeek-V3 (FP8, as "
                   "published)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the GPUs of this machine")
    p.add_argument("--nodes", type=int, default=None, help="default: 1")
    p.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 80GiB (default: this machine's)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default: the checkpoint's (bfloat16 unless it says float32/float16)")
    p.add_argument("--quantization-bits", type=int, choices=[2, 3, 4, 8], default=None,
                   help="weight quantization width for linear layers")
    p.add_argument("--quantization", choices=["int8", "int4", "fp8", "fp8_per_channel", "fp8_per_tensor",
                                              "fp8_per_block", "gptq", "awq", "compressed-tensors"], default=None,
                   help="as `serve --quantization`: the bits the engine loads, scales included")
    p.add_argument("--quantization-group-size", type=int, default=None, help="as `serve`")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's maximum, at most 8192")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"], default="auto",
                   help="as `serve --kv-cache-dtype`: fp8 counts one byte a cached value")
    p.add_argument("-dcp", "--decode-context-parallel-size", type=int, default=1,
                   help="as `serve -dcp`: each sequence's KV cache spread over this many ranks of each TP group "
                        "(splits where it cannot run say why)")
    p.add_argument("--concurrency", type=int, default=None, help="requests of max_model_len to serve at once")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--interconnect", choices=["nvlink", "pcie"], default="nvlink")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(ns) -> None:
    from shardlm.config import parse_size
    from shardlm.model_loader.gptq_awq import checkpoint_method
    from shardlm.planner import ModelShape, Workload, load_config, recommend
    from shardlm.planner.hardware import described_hardware
    from shardlm.planner.report import render, to_json
    name, cfg = load_config(ns.model)
    shape = ModelShape.from_config(name, cfg)
    hw = described_hardware(ns.gpu_memory_utilization, ns.gpus_per_node, ns.nodes,
                            parse_size(ns.gpu_memory) if ns.gpu_memory else None, ns.interconnect)
    bits = ns.quantization_bits
    stored = checkpoint_method(cfg.get("quantization_config"))     # a GPTQ/AWQ/FP8 checkpoint
    if ns.quantization or (stored and bits is None):
        # what the engine loads: the integers plus a float32 scale and min per group
        from shardlm.engine.arg_utils import resolve_quantization
        bits = resolve_quantization(ns.quantization, ns.quantization_group_size,
                                    checkpoint=stored).effective_bits(shape.hidden)
    workload = Workload.for_checkpoint(cfg, shape, ns.dtype, ns.max_model_len, bits, ns.concurrency)
    workload.dcp = ns.decode_context_parallel_size
    workload.kv_cache_dtype = ns.kv_cache_dtype
    rec = recommend(shape, hw, workload, ns.model)
    print(to_json(rec) if ns.json else render(rec))
