"""Will a model fit, and how should it be split: per-rank memory for a parallel layout and the
recommendation that follows the usual guide (one device; else tensor parallel inside a node;
else tensor parallel = devices per node and pipeline parallel = nodes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from shardlm.planner.layer_placement import pp_layer_partition
from shardlm.planner.model_shape import ModelShape

GiB = 1 << 30
KV_ROOM_FOR_TIGHT = 0.20      # below this share of usable memory left for KV cache: "tight"
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Hardware:
    kind: str                      # "gpu" or "cpu"
    devices_per_node: int
    nodes: int
    device_memory: int             # bytes per device
    utilization: float = 0.9       # share of device memory the engine may use
    interconnect: str = "nvlink"

    @property
    def usable(self) -> float:
        return self.device_memory * self.utilization

    @property
    def total_devices(self) -> int:
        return self.devices_per_node * self.nodes


@dataclass
class Workload:
    dtype: str = "bfloat16"
    quantization_bits: int | None = None
    max_model_len: int = 8192
    concurrency: int | None = None            # wanted concurrent requests at max_model_len
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    hybrid_kv_cache: bool = True              # sliding-window layers keep only their window (kv_cache_groups.py)
    dcp: int = 1                              # `plan -dcp`: decode context parallel in every split
    kv_cache_dtype: str = "auto"              # --kv-cache-dtype: fp8 stores one byte a value

    @classmethod
    def for_checkpoint(cls, cfg: dict, shape: ModelShape, dtype: str | None = None, max_model_len: int | None = None,
                       quantization_bits: int | None = None, concurrency: int | None = None) -> Workload:
        """`shardlm plan`'s defaults: the checkpoint's dtype (bfloat16 unless it says float32 or
        float16) and its context, at most 8192."""
        stored = cfg.get("torch_dtype") or cfg.get("dtype")
        dtype = dtype or {"float32": "float32", "float16": "float16"}.get(stored, "bfloat16")
        return cls(dtype=dtype, quantization_bits=quantization_bits,
                   max_model_len=max_model_len or min(shape.max_position, 8192), concurrency=concurrency)

    @property
    def kv_dtype_bytes(self) -> int:
        return 1 if self.kv_cache_dtype.startswith("fp8") else self.dtype_bytes

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]


@dataclass
class SplitPlan:
    tp: int
    pp: int
    dp: int = 1
    ep: int = 0                               # expert parallel group size (0: experts sliced by TP)
    dcp: int = 1                              # decode context parallel ranks per TP group
    pcp: int = 1                              # prefill context parallel TP groups per stage
    weights_per_device: float = 0.0           # bytes, the fullest stage
    reserve_per_device: float = 0.0           # activations + runtime overhead
    kv_bytes_per_token: float = 0.0           # per device, the fullest stage
    kv_blocks: int = 0
    kv_tokens: int = 0
    max_concurrency: float = 0.0              # KV tokens / max_model_len
    status: str = "no"                        # "yes", "tight" or "no"
    reason: str = ""
    stages: list[dict] = field(default_factory=list)

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp * self.pcp

    @property
    def label(self) -> str:
        parts = [f"TP={self.tp}"] + ([f"PP={self.pp}"] if self.pp > 1 else [])
        parts += [f"DP={self.dp}"] if self.dp > 1 else []
        parts += [f"EP={self.ep}"] if self.ep else []
        parts += [f"DCP={self.dcp}"] if self.dcp > 1 else []
        parts += [f"PCP={self.pcp}"] if self.pcp > 1 else []
        return " ".join(parts) if (self.tp, self.pp, self.dp) != (1, 1, 1) else "single device"


def weight_bytes(shape: ModelShape, params: float, linear_params: float, w: Workload) -> float:
    """Linear layers at the quantization width (if any); embeddings and norms at the dtype."""
    if w.quantization_bits is None:
        return params * w.dtype_bytes
    return linear_params * w.quantization_bits / 8 + (params - linear_params) * w.dtype_bytes


def activation_reserve(shape: ModelShape, tp: int, w: Workload, hw: Hardware) -> float:
    """Peak activations of the largest step (max_num_batched_tokens tokens through one layer,
    float32 logits for max_num_seqs rows) plus runtime overhead (1 GiB on GPUs for the CUDA
    context and communication buffers, 0.5 GiB on CPU)."""
    inter = max(shape.intermediate, shape.expert_intermediate * max(1, shape.experts_per_token))
    per_token = (6 * shape.hidden + (shape.heads + 2 * shape.kv_heads) * shape.head_dim / tp + 3 * inter / tp)
    acts = w.max_num_batched_tokens * per_token * w.dtype_bytes
    logits = w.max_num_seqs * shape.vocab * 4
    return acts + logits + (GiB if hw.kind == "gpu" else GiB // 2)


def evaluate(shape: ModelShape, tp: int, pp: int, hw: Hardware, w: Workload, ep: int = 0, dcp: int = 1,
             pcp: int = 1) -> SplitPlan:
    """ep > 0: expert parallel over ep ranks (tp, or dp x tp with data parallel replicas); dcp:
    decode context parallel ranks per TP group, pcp: prefill context parallel TP groups (each
    rank holds 1/(dcp x pcp) of every sequence's KV)."""
    plan = SplitPlan(tp, pp, dp=max(1, ep // tp), ep=ep, dcp=dcp, pcp=pcp)
    problems = shape.tp_problems(tp, expert_parallel=ep > 0) + shape.dcp_problems(tp, dcp)
    if problems:
        plan.reason = "; ".join(problems)
        return plan
    if pp > shape.layers:
        plan.reason = f"more stages than the {shape.layers} layers"
        return plan
    reserve = activation_reserve(shape, tp, w, hw)
    worst_weights, worst_kv = 0.0, 0.0
    for s, (start, end) in enumerate(pp_layer_partition(shape.layers, pp, head_layers=shape.lm_head_layers())):
        params = sum(shape.layer_params(i, tp, ep) for i in range(start, end))
        linear = params - 2 * shape.hidden * (end - start)
        extra = []
        if s == 0:
            params += shape.embedding_params(tp) + shape.vision_params
            extra.append("embed" + (" + vision" if shape.vision_params else ""))
        if s == pp - 1:
            params += shape.hidden                       # final norm
            lm_head = 0 if (shape.tied and pp == 1) else shape.embedding_params(tp)
            params += lm_head
            extra += ["norm", "lm_head"]
        wb = weight_bytes(shape, params, linear, w)
        # context parallel keeps every position of every layer (one KV cache group)
        layers = (shape.kv_layers(start, end, w.max_model_len, w.block_size) if w.hybrid_kv_cache and dcp * pcp == 1
                  else end - start)
        kv = shape.kv_bytes_per_token(w.kv_dtype_bytes, layers, tp) / (dcp * pcp)
        plan.stages.append({"stage": s, "layers": [start, end - 1], "holds": extra, "weights_bytes": wb,
                            "kv_bytes_per_token": kv})
        worst_weights, worst_kv = max(worst_weights, wb), max(worst_kv, kv)
    plan.weights_per_device, plan.reserve_per_device, plan.kv_bytes_per_token = worst_weights, reserve, worst_kv
    # the stage with the least room sets the KV cache size (all ranks allocate the same block count)
    room = min(hw.usable - st["weights_bytes"] - reserve for st in plan.stages)
    per_block = max(st["kv_bytes_per_token"] for st in plan.stages) * w.block_size
    plan.kv_blocks = max(0, int(room // per_block)) if room > 0 else 0
    plan.kv_tokens = plan.kv_blocks * w.block_size      # (kv per token already counts 1/(dcp x pcp))
    plan.max_concurrency = plan.kv_tokens / w.max_model_len
    if room <= 0:
        plan.reason = (f"weights {worst_weights / GiB:.1f} GiB + reserve {reserve / GiB:.1f} GiB exceed the "
                       f"{hw.usable / GiB:.1f} GiB usable per device")
    elif plan.kv_tokens < w.max_model_len:
        plan.reason = f"KV cache room for {plan.kv_tokens} tokens, less than one {w.max_model_len}-token request"
    elif w.concurrency and plan.max_concurrency < w.concurrency:
        plan.status = "tight"
        plan.reason = (f"{plan.max_concurrency:.1f} requests of {w.max_model_len} tokens fit, fewer than the "
                       f"{w.concurrency} wanted")
    elif room < KV_ROOM_FOR_TIGHT * hw.usable:
        plan.status = "tight"
        plan.reason = f"only {room / GiB:.1f} GiB ({room / hw.usable:.0%}) of each device left for the KV cache"
    else:
        plan.status = "yes"
    return plan


def candidate_splits(shape: ModelShape, hw: Hardware) -> list[tuple[int, int]]:
    """Layouts worth comparing: inside one node every TP x PP that fits the node's devices;
    across nodes, TP = devices per node (TP never spans nodes) and PP = nodes used."""
    out = []
    for tp in range(1, hw.devices_per_node + 1):
        for pp in range(1, hw.devices_per_node // tp + 1):
            out.append((tp, pp))
    valid_tp = [t for t in shape.valid_tp_sizes(hw.devices_per_node)]
    node_tp = max(valid_tp) if valid_tp else 1
    for nodes in range(2, hw.nodes + 1):
        out.append((node_tp, nodes * (hw.devices_per_node // node_tp)))
    return sorted(set(out), key=lambda s: (s[0] * s[1], s[1]))


@dataclass
class Recommendation:
    model: str
    params: int
    active_params: int
    weights_bytes: float
    rule_of_thumb_bytes: float
    kv_bytes_per_token: float
    hardware: Hardware
    workload: Workload
    plan: SplitPlan | None
    reasons: list[str]
    notes: list[str]
    alternatives: list[SplitPlan]
    command: str | None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["plan"] = asdict(self.plan) if self.plan else None
        d["alternatives"] = [asdict(a) | {"label": a.label} for a in self.alternatives]
        if self.plan:
            d["plan"]["label"] = self.plan.label
        return d


def _choose(plans: list[SplitPlan], hw: Hardware) -> SplitPlan | None:
    """The guide's order: one device; tensor parallel inside a node (smallest size); tensor x
    pipeline inside a node; whole-node tensor parallel with pipeline stages across nodes.
    The first layout with room wins; failing that, the first that fits at all ("tight")."""
    groups = [[p for p in plans if (p.tp, p.pp) == (1, 1)],
              [p for p in plans if p.pp == 1 and p.tp > 1 and p.tp <= hw.devices_per_node],
              [p for p in plans if p.pp > 1 and p.tp * p.pp <= hw.devices_per_node],
              [p for p in plans if p.tp * p.pp > hw.devices_per_node]]
    for wanted in ("yes", "tight"):
        for group in groups:
            pick = next((p for p in group if p.status == wanted), None)
            if pick:
                return pick
    return None


def recommend(shape: ModelShape, hw: Hardware, w: Workload, model_arg: str | None = None) -> Recommendation:
    plans = [evaluate(shape, tp, pp, hw, w, dcp=w.dcp) for tp, pp in candidate_splits(shape, hw)]
    params = shape.total_params()
    weights = weight_bytes(shape, params, params * shape.linear_params_share(), w)
    reasons, notes = [], []
    pick = _choose(plans, hw)
    one = plans[0]
    if pick is one:
        reasons.append(f"The model fits on one device ({one.weights_per_device / GiB:.1f} GiB of weights, "
                       f"{one.kv_tokens} tokens of KV cache): no parallelism needed.")
    elif pick is not None:
        reasons.append(f"One device is not enough: {one.reason}.")
        valid = ", ".join(map(str, shape.valid_tp_sizes(hw.devices_per_node)))
        if pick.pp == 1:
            reasons.append(f"Tensor parallel inside one node: TP={pick.tp} is the smallest valid size with room "
                           f"for the KV cache (valid sizes up to {hw.devices_per_node} devices: {valid}).")
        elif pick.tp * pick.pp <= hw.devices_per_node:
            reasons.append(f"No valid tensor parallel size up to {hw.devices_per_node} devices ({valid}) leaves room "
                           f"for the KV cache; inside one node {pick.label} does.")
        else:
            reasons.append(f"One node ({hw.devices_per_node} x {hw.device_memory / GiB:.0f} GiB) is not enough: "
                           f"TP={pick.tp} inside each node and PP={pick.pp} across nodes. Tensor parallel never "
                           "spans nodes: it all-reduces every layer, which the network between nodes cannot keep "
                           "up with.")
        if pick.status == "tight":
            reasons.append(f"It is tight: {pick.reason}.")
        if w.quantization_bits is None:
            q4 = evaluate(shape, 1, 1, hw, Workload(**{**asdict(w), "quantization_bits": 4}))
            if q4.status != "no":
                notes.append("With 4-bit weight quantization it would fit on one device "
                             f"({q4.weights_per_device / GiB:.1f} GiB of weights).")
    else:
        reasons.append(f"No layout of {hw.total_devices} device(s) x {hw.device_memory / GiB:.0f} GiB fits "
                       f"(single device: {one.reason}).")
        if w.quantization_bits is None:
            for bits in (8, 4):
                qw = Workload(**{**asdict(w), "quantization_bits": bits})
                qpick = _choose([evaluate(shape, tp, pp, hw, qw, dcp=w.dcp) for tp, pp in candidate_splits(shape, hw)],
                                hw)
                if qpick:
                    reasons.append(f"With {bits}-bit weight quantization it fits as {qpick.label}.")
                    break
        needed = weights / hw.usable
        reasons.append(f"The weights alone need {weights / GiB:.0f} GiB: at least {needed:.1f} devices of this size.")
    if hw.devices_per_node > 1 and shape.tp_problems(hw.devices_per_node):
        notes.append(f"TP={hw.devices_per_node} (all devices of a node) is not valid: "
                     f"{'; '.join(shape.tp_problems(hw.devices_per_node))}. Valid TP sizes: "
                     f"{', '.join(map(str, shape.valid_tp_sizes()))}. Use PP={hw.devices_per_node}, or TP with a "
                     "valid size.")
    if pick is not None:
        dp = hw.total_devices // pick.devices
        local_dp = hw.devices_per_node // pick.devices
        if local_dp > 1:
            dp_command = _serve_command(model_arg or shape.name, pick.tp, pick.pp, local_dp, w.max_model_len)
            notes.append(f"For more throughput, data parallel: {local_dp} replicas of {pick.label} on the "
                         f"{hw.devices_per_node} devices of a node, the server spreading requests over them: "
                         f"{dp_command}")
        if dp > local_dp and dp > 1:
            notes.append(f"Data parallel across nodes: {dp} replicas of {pick.label} on the {hw.total_devices} "
                         f"devices, {max(local_dp, 1)} per node: the head runs `shardlm serve ... -dp {dp} "
                         f"--data-parallel-size-local {max(local_dp, 1)} --data-parallel-address HEAD_IP "
                         "--data-parallel-rpc-port PORT`, every other node the same with --headless and its "
                         "--data-parallel-start-rank (or --data-parallel-backend ray on a Ray cluster).")
        if hw.interconnect == "pcie" and pick.tp > 1:
            notes.append("Without NVLink, tensor parallel all-reduces cross PCIe every layer: expect less speed-up "
                         "than on NVLink; pipeline parallel sends far less data between devices.")
        if shape.is_moe:
            notes += _expert_parallel_notes(shape, pick, local_dp, hw, w, model_arg or shape.name)
        notes += _decode_context_parallel_notes(shape, pick, hw, w, model_arg or shape.name)
    kv_per_token = shape.kv_bytes_per_token(w.kv_dtype_bytes)
    windowed = [x for x in shape.windows if x is not None and x < w.max_model_len]
    if windowed and w.hybrid_kv_cache:
        every = kv_per_token
        kv_per_token = shape.kv_bytes_per_token(w.kv_dtype_bytes, shape.kv_layers(0, shape.layers, w.max_model_len,
                                                                                w.block_size))
        notes.append(f"{len(windowed)} of the {shape.layers} layers attend within a sliding window of "
                     f"{max(windowed)} tokens and keep only that: {kv_per_token / 1024:.1f} KiB of KV cache per token "
                     f"at max_model_len {w.max_model_len}, against {every / 1024:.1f} KiB with every position kept "
                     "(--disable-hybrid-kv-cache-manager, or context parallel).")
    command = None
    if pick is not None:
        command = _serve_command(model_arg or shape.name, pick.tp, pick.pp, 1, w.max_model_len, dcp=w.dcp)
    shown = [p for p in plans if not shape.tp_problems(p.tp)][:10]
    if pick is not None and pick not in shown:
        shown.append(pick)
    return Recommendation(shape.name, params, shape.active_params(), weights, params * w.dtype_bytes * 1.2,
                          kv_per_token, hw, w, pick, reasons, notes, shown, command)


def expert_bytes_per_rank(shape: ModelShape, plan: SplitPlan, w: Workload) -> float:
    """Routed expert weights on the fullest rank of the fullest stage."""
    expert = 3 * shape.hidden * shape.expert_intermediate
    per_layer = shape.experts_per_rank(plan.ep) * expert if plan.ep else shape.num_experts * expert / plan.tp
    stages = pp_layer_partition(shape.layers, plan.pp, head_layers=shape.lm_head_layers())
    layers = max(sum(shape.is_moe_layer(i) for i in range(a, b)) for a, b in stages)
    return weight_bytes(shape, per_layer * layers, per_layer * layers, w)


def _expert_parallel_notes(shape: ModelShape, pick: SplitPlan, local_dp: int, hw: Hardware, w: Workload,
                           model: str) -> list[str]:
    """Experts per rank sliced by TP against whole experts under --enable-expert-parallel, within
    the picked split and, with room for replicas, across DP x TP (attention replicated)."""
    notes = [f"Mixture of experts ({shape.num_experts} experts, {shape.experts_per_token} per token): "
             f"{pick.label} slices every expert across the TP ranks "
             f"({expert_bytes_per_rank(shape, pick, w) / GiB:.2f} GiB of experts per rank)."]
    if pick.tp > 1:
        ep = evaluate(shape, pick.tp, pick.pp, hw, w, ep=pick.tp)
        notes.append(f"With expert parallel each of the {pick.tp} ranks holds whole experts instead, at most "
                     f"{shape.experts_per_rank(pick.tp)} ({expert_bytes_per_rank(shape, ep, w) / GiB:.2f} GiB per "
                     "rank), and a token's expert work is done only where its experts are (fewer, larger matmuls; "
                     "an uneven routing loads some ranks more): "
                     f"{_serve_command(model, pick.tp, pick.pp, 1, w.max_model_len, expert_parallel=True)}")
    if local_dp > 1:
        ranks = local_dp * pick.tp       # the EP group: every DP x TP rank of one stage
        dpep = evaluate(shape, pick.tp, pick.pp, hw, w, ep=ranks)
        where = f"all {ranks} ranks" if pick.pp == 1 else f"the {ranks} ranks of its stage"
        notes.append(f"Data parallel attention with expert parallel experts ({local_dp} replicas, a layer's experts "
                     f"spread over {where}: at most {shape.experts_per_rank(ranks)} per rank, "
                     f"{expert_bytes_per_rank(shape, dpep, w) / GiB:.2f} GiB; {dpep.kv_tokens} KV tokens per "
                     "replica; the replicas run their MoE layers in lock-step): "
                     f"{_serve_command(model, pick.tp, pick.pp, local_dp, w.max_model_len, expert_parallel=True)}")
    return notes


# contexts from which decode context parallel is worth recommending: below, the KV cache of a
# request is small next to the weights and the extra collectives per layer cost more than it saves
DCP_MIN_CONTEXT = 16384


def _decode_context_parallel_notes(shape: ModelShape, pick: SplitPlan, hw: Hardware, w: Workload,
                                   model: str) -> list[str]:
    """Where tensor parallel replicates KV heads (tp above their number) and contexts are long:
    the largest -dcp that spreads each sequence's KV cache over the replicas, and what it holds."""
    sizes = shape.valid_dcp_sizes(pick.tp)
    if w.dcp > 1 or len(sizes) < 2 or w.max_model_len < DCP_MIN_CONTEXT:
        return []
    dcp = sizes[-1]
    spread = evaluate(shape, pick.tp, pick.pp, hw, w, dcp=dcp)
    if shape.is_mla:
        replicated = f"Latent attention keeps one latent KV cache, the same on all {pick.tp} TP ranks"
    else:
        copies = pick.tp // shape.kv_heads
        replicated = f"TP={pick.tp} replicates each of the {shape.kv_heads} KV heads on {copies} ranks"
    return [f"{replicated}, so every rank stores every sequence's whole KV cache. Decode context parallel spreads "
            f"it by position over {dcp} of them: {spread.kv_tokens} KV tokens instead of {pick.kv_tokens} (max "
            f"concurrency at {w.max_model_len}: {spread.max_concurrency:.1f}x), for two more collectives per layer: "
            f"{_serve_command(model, pick.tp, pick.pp, 1, w.max_model_len, dcp=dcp)}"]


def _serve_command(model: str, tp: int, pp: int, dp: int, max_model_len: int, expert_parallel: bool = False,
                   dcp: int = 1) -> str:
    command = f"shardlm serve {model}"
    command += f" -tp {tp}" if tp > 1 else ""
    command += f" -pp {pp}" if pp > 1 else ""
    command += f" -dp {dp}" if dp > 1 else ""
    command += f" -dcp {dcp}" if dcp > 1 else ""
    command += " --enable-expert-parallel" if expert_parallel else ""
    return command + f" --max-model-len {max_model_len}"
