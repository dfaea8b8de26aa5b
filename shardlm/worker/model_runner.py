"""Runs one scheduler step on this rank:

    update request state -> the step's batch (worker/step_builder.py: order, tokens, attention
      layout, context parallel split) -> tensors and attention metadata -> run the model (or this
      pipeline stage) -> the rows that need logits -> sample (and verify proposed tokens)
      -> prompt logprobs -> propose the next tokens (speculative decoding)

What the batch looks like is the step builder's; running it is one method each below.
Attention goes through the backend chosen once for this device (shardlm/attention/selector.py);
the runner builds its metadata once per step.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from shardlm import cpu_plan
from shardlm.attention.backend import KVGroupsMetadata, LastLayerRows
from shardlm.attention.context_parallel import ContextShard
from shardlm.attention.selector import get_attention_backend
from shardlm.config import EngineConfig
from shardlm.distributed.parallel_state import (
    get_cp_group,
    get_dcp_group,
    get_dp_group,
    get_pcp_group,
    get_pp_group,
    get_tp_group,
)
from shardlm.kernels import amx
from shardlm.layers.attention import Attention
from shardlm.layers.moe import FusedMoE, dp_token_counts, redundant_experts
from shardlm.layers.sampler import Sampler, SamplingBatch, TokenBitmask, completing_bad_words, token_logprobs
from shardlm.logger import init_logger
from shardlm.logits_processor import engine_logits_processors
from shardlm.lora import batch as lora_batch
from shardlm.lora.manager import LoRAManager
from shardlm.messages import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from shardlm.model_loader.weights import load_model
from shardlm.models.eagle3 import aux_layers_of
from shardlm.models.llama import prepare_fused_decode
from shardlm.models.registry import get_model_class
from shardlm.multimodal import embeddings as image_embeddings
from shardlm.multimodal.vision_encoder import load_vision_encoder
from shardlm.planner.layer_placement import stage_layers
from shardlm.pooling.bert import EncoderBatch
from shardlm.pooling.pooler import pool_step
from shardlm.spec_decode.proposer import ProposalRequest, Proposer, TargetStep
from shardlm.spec_decode.selector import make_proposer
from shardlm.spec_decode.verify import accepted_tokens
from shardlm.worker.cpu_tuning import zeroed_buffer
from shardlm.worker.cuda_graphs import CudaGraphs, graphs_unavailable_reason
from shardlm.worker.expert_balancer import ExpertBalancer
from shardlm.worker.logits_processors import CustomLogitsProcessors
from shardlm.worker.step_builder import RequestState, StepBatch, StepBuilder

logger = init_logger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device):
        self.config = config
        self.device = device
        self.block_size = config.cache.block_size
        self.model: torch.nn.Module | None = None
        self._attention_layers: list[Attention] | None = None
        self._moe_layers: dict[int, FusedMoE] | None = None
        self.sampler = Sampler(config.model.logprobs_mode)
        # custom logits processors, made here (one whose __init__ fails stops start-up, named); the
        # rank that samples uses them, and on every rank they rule out the TP ranks' shared argmax
        classes = engine_logits_processors(config)
        self.logits_processors = CustomLogitsProcessors(classes, config, device) if classes else None
        self.kv_groups = config.kv_groups
        # one backend per KV cache group (each builds its group's metadata; the first is the engine's)
        self.attn_backends = [get_attention_backend(config, device) for _ in range(self.kv_groups.num_groups)]
        self.attn_backend = self.attn_backends[0]
        self.requests: dict[str, RequestState] = {}
        self.stop_ids_for_min_tokens = list(config.model.eos_token_ids)
        self.dp_lockstep = config.dp_lockstep
        self.cuda_graphs: CudaGraphs | None = None
        self.use_cuda_graphs = False
        self.lora: LoRAManager | None = None
        self.proposer: Proposer | None = None          # speculative decoding, on the rank that samples
        self.enforce_eager = config.model.enforce_eager
        self.num_blocks: int | None = None              # KV cache blocks, once the cache is bound
        self.balancer: ExpertBalancer | None = None      # --enable-eplb: places the experts anew now and then
        self._kv_tensors: list[tuple[torch.Tensor, torch.Tensor]] = []     # (K, V) per slot (attention_layers)
        self.vision = None          # a vision-language model's vision encoder, on the first stage (multimodal/)

    @staticmethod
    def _choose_amx(batch_invariant: bool, quantization) -> None:
        """bfloat16 products on the AMX tiles from the rows the CPU plan chose for the kinds of
        weight this model has (kernels/amx.py), logged where the CPU has the tiles, with why not
        where this process cannot use them."""
        why_not = amx.unavailable()
        rows = amx.AmxRows() if why_not else amx.choose(batch_invariant, amx.kinds_of(quantization))
        amx.use(rows)
        if why_not and amx.cpu_has_tiles():
            logger.warning("bfloat16 products run on the vector tiles, not AMX: %s.", why_not)
        elif not why_not:
            logger.info("bfloat16 products on the AMX tiles: %s", amx.describe(rows, batch_invariant))

    def load_model(self) -> None:
        par = self.config.parallel
        m = self.config.model
        cpu_plan.record(batch_invariant=m.batch_invariant)       # which float weights go into panels
        if self.device.type == "cpu" and m.dtype == torch.bfloat16:
            self._choose_amx(m.batch_invariant, m.quantization)
        stages = stage_layers(self.config.model, par)
        self.pp, self.tp, self.pcp = get_pp_group(), get_tp_group(), get_pcp_group()
        cp = get_cp_group()
        if cp.world_size > 1:           # context parallel: this rank's share of every sequence
            self.attn_backend.shard = ContextShard(cp.world_size, cp.rank_in_group, par.dcp_kv_cache_interleave_size,
                                                   self.block_size, get_dcp_group().world_size)
        eplb = par.eplb
        with redundant_experts(eplb.num_redundant_experts if eplb is not None else None):
            self.model = load_model(get_model_class(m.architecture, m.convert, m.model_impl), m, self.device,
                                    stages[self.pp.rank_in_group])
        if m.multimodal is not None and self.pp.is_first_rank:
            self.vision = load_vision_encoder(m, self.device)
        if eplb is not None and self.moe_layers():
            self.balancer = ExpertBalancer(self.moe_layers(), eplb)
        spec = self.config.speculative
        if spec is not None and spec.method == "eagle3":     # every rank: each stage hands its layers' on
            self.model.model.aux_layers = aux_layers_of(spec.draft_model_config.hf_config, self.config.model.num_layers)
        if self.pp.is_last_rank and self.tp.rank_in_group == 0 and self.pcp.rank_in_group == 0:
            self.proposer = make_proposer(self.config, self.device, self.attn_backend)
        if self.config.lora is not None:
            m = self.config.model
            self.lora = LoRAManager(self.model, self.config.lora, m.hf_config, m.dtype, self.device, m.download_dir)
        self.step_builder = StepBuilder(self.requests, self.lora.slots_of if self.lora is not None else None,
                                        self.config.lora.max_loras if self.lora is not None else 0, self.device,
                                        self.pcp.world_size, self.pcp.rank_in_group, self.attn_backend.shard)
        if self.device.type == "cuda":
            reason = graphs_unavailable_reason(self)
            if reason is None:
                self.cuda_graphs = CudaGraphs(self.model, self.attn_backend)
            elif not self.config.model.enforce_eager:
                logger.info("CUDA graphs off (%s): every step runs eagerly", reason)
        self.set_enforce_eager(self.config.model.enforce_eager)
        # whether the last layer may finish only the sampled rows (_last_layer_rows): not where
        # another reader wants every row's final hidden state (a draft model, pooling), nor where
        # a layer's rows are laid out across ranks (context parallel) or replicas (DP + EP)
        self._finishes_rows = (getattr(getattr(self.model, "model", None), "finishes_rows", False) and spec is None
                               and self.config.model.pooler is None and cp.world_size == 1
                               and self.pcp.world_size == 1 and len(self.attn_backends) == 1 and not self.dp_lockstep)

    def set_enforce_eager(self, on: bool) -> None:
        """--enforce-eager: every step layer by layer (on); off: decode steps replayed from CUDA
        graphs on a GPU, through the one-call path on CPU, where they apply. Switchable at run
        time, to compare the two on the same weights and kernel choices."""
        self.enforce_eager = on
        self.use_cuda_graphs = not on and self.cuda_graphs is not None
        if self.num_blocks is not None:       # else initialize_cache prepares it
            self._prepare_cpu_decode()

    def _prepare_cpu_decode(self) -> None:
        """The one-call decode step of each stage, once the KV cache is bound (CPU); the CPU plan
        records how decode steps run."""
        if self.device.type != "cpu":
            return
        cpu_plan.record(decode_path=prepare_fused_decode(self.model, not self.enforce_eager))

    def attention_layers(self) -> list[Attention]:
        """This rank's attention layers, each told its KV cache group and its tensor slot: the
        layers at the same place in their groups share one K and one V tensor (kv_cache_groups.py)."""
        if self._attention_layers is None:
            layers = [(name, m) for name, m in self.model.named_modules() if isinstance(m, Attention)]
            place_in_group = [0] * self.kv_groups.num_groups
            for name, attn in layers:
                if self.kv_groups.num_groups > 1:
                    attn.kv_group = self.kv_groups.group_of_layer(int(name.split(".layers.")[1].split(".")[0]))
                attn.kv_slot = place_in_group[attn.kv_group]
                place_in_group[attn.kv_group] += 1
            self._attention_layers = [m for _, m in layers]
        return self._attention_layers

    def _kv_slots(self) -> dict[int, Attention]:
        """The first layer of each K/V tensor slot: the tensors' shapes."""
        firsts: dict[int, Attention] = {}
        for attn in self.attention_layers():
            first = firsts.setdefault(attn.kv_slot, attn)
            if (first.num_kv_heads, first.head_dim, first.v_head_dim) != (attn.num_kv_heads, attn.head_dim,
                                                                           attn.v_head_dim):
                raise ValueError("Layers whose KV cache shapes differ cannot share a block id: start with "
                                 "--disable-hybrid-kv-cache-manager.")
        return firsts

    def moe_layers(self) -> dict[int, FusedMoE]:
        """This rank's MoE layers by decoder layer index (found once: dummy steps use them every step)."""
        if self._moe_layers is None:
            self._moe_layers = {int(name.split(".layers.")[1].split(".")[0]): m
                                for name, m in self.model.named_modules() if isinstance(m, FusedMoE)}
        return self._moe_layers

    def kv_cache_bytes_per_block(self) -> int:
        """This rank's KV bytes per block: its layers' K/V tensors (one per layer, or per slot shared
        by the KV cache groups), its share of the KV heads."""
        dtype_size = torch.empty((), dtype=self.config.kv_cache_torch_dtype).element_size()
        draft = self.proposer.kv_cache_bytes_per_block() if self.proposer is not None else 0
        return draft + sum(self.block_size * a.cache_values_per_token() * dtype_size for a in self._kv_slots().values())

    def initialize_cache(self, num_blocks: int) -> None:
        dtype = self.config.kv_cache_torch_dtype
        # context parallel: one more block, the sink where positions of other ranks go
        sink = self.attn_backend.shard is not None
        self.attn_backend.sink_slot = num_blocks * self.block_size
        self._kv_tensors = []
        for a in self._kv_slots().values():
            shape = self.attn_backend.kv_cache_shape(num_blocks + sink, a.num_kv_heads, a.head_dim)
            k = self._zeros(shape, dtype)
            # multi-head latent attention: the values are the keys' first dims, no cache of their own
            self._kv_tensors.append((k, k[..., :a.v_head_dim] if a.values_in_keys else self._zeros(shape, dtype)))
        for attn in self.attention_layers():
            attn.k_cache, attn.v_cache = self._kv_tensors[attn.kv_slot]
            attn.backend = self.attn_backends[attn.kv_group]
        if self.proposer is not None:
            self.proposer.initialize_cache(num_blocks)
        self.num_blocks = num_blocks
        self._prepare_cpu_decode()
        # CPU: blocks below this id have had their memory faulted in (block 0 is read as padding)
        self._faulted_blocks = 1 if self.device.type == "cpu" else num_blocks
        self._fault_chunk = max(1, (64 << 20) // max(1, self.kv_cache_bytes_per_block()))

    def release_cache(self) -> None:
        self.num_blocks = None
        self._kv_tensors = []
        for attn in self.attention_layers():
            attn.k_cache = attn.v_cache = None
        if self.proposer is not None:
            self.proposer.release_cache()
        if self.device.type == "cpu":        # the one-call decode step holds the cache's addresses
            prepare_fused_decode(self.model, False)
        if self.cuda_graphs is not None:     # so do captured graphs: they are captured again as needed
            self.cuda_graphs = CudaGraphs(self.model, self.attn_backend)

    def release_model(self) -> None:
        """Sleep level 2: the weights go (load_model reads them again)."""
        self.model = self.cuda_graphs = self.vision = None
        self._attention_layers = self._moe_layers = None

    def kv_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(self._kv_tensors)

    def _zeros(self, shape, dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return zeroed_buffer(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def weight_bytes(self) -> int:
        # a tied LM head shares its embedding's quantized table: counted once
        tables = {id(m.quant): m.quant for m in self.model.modules() if getattr(m, "quant", None) is not None}
        quantized = sum(q.weight_bytes() for q in tables.values())
        draft = self.proposer.weight_bytes() if self.proposer is not None else 0
        vision = sum(p.numel() * p.element_size() for p in self.vision.parameters()) if self.vision is not None else 0
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) + quantized + draft + vision

    # ---- one step ----
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """The sampled tokens on the rank that samples; None on the others."""
        if not self.config.model.collect_detailed_traces:
            return self._execute(so)
        t0 = time.perf_counter()
        out = self._execute(so)
        if out is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            out.forward_seconds = time.perf_counter() - t0
        return out

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self._update_requests(so)
        if not so.chunks:
            return ModelRunnerOutput({})
        batch = self.step_builder.build(so.chunks)
        chunks = batch.chunks
        input_ids, positions, meta = self._prepare_inputs(batch)
        with dp_token_counts(self._tokens_per_replica(len(input_ids))), lora_batch.running(batch.lora), \
                image_embeddings.running(self._image_embeddings(batch)):
            hidden = self._run_model(input_ids, positions, meta)
        if self.balancer is not None:
            self.balancer.after_forward()
        if hidden is None:                  # not the last pipeline stage: sent on
            return None
        aux_hidden = getattr(getattr(self.model, "model", None), "aux_hidden", None)    # EAGLE-3's input
        if batch.pcp is not None:           # every group's tokens to the first, which samples
            hidden = self._gather_pcp_hidden(hidden, batch.pcp.groups)
            if aux_hidden is not None:
                aux_hidden = self._gather_pcp_hidden(aux_hidden, batch.pcp.groups)
            if hidden is None:
                return None
            input_ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
            positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        if self.config.model.pooler is not None:      # pooling requests end with their result
            if self.tp.rank_in_group != 0:             # (the rank that answers: its hidden states are everyone's)
                return None
            out = ModelRunnerOutput({}, pooled=pool_step(self.model, self.config.model.pooler, hidden, chunks, {
                c.req_id: self.requests[c.req_id].pooling_params for c in chunks}))
        else:
            out = self._sample(so, chunks, hidden, getattr(meta, "last_layer", None) is not None)
        if out is not None and self.lora is not None and self.lora.unreadable:
            out.failed |= self.lora.failed_requests({c.req_id: self.requests[c.req_id].lora_int_id for c in chunks})
        if self.proposer is not None:       # the rank that samples: out is its result (never a pooling model's)
            self.proposer.follow(TargetStep(input_ids, positions, meta, hidden, chunks, out.sampled, self.requests,
                                            aux_hidden))
            wanted = so.propose_drafts
            if wanted and out.sampled:
                out.draft_token_ids = self.proposer.propose([
                    ProposalRequest(c.req_id, s.prompt_token_ids, s.output_token_ids, c.block_tables[0],
                                    wanted[c.req_id])
                    for c in chunks if c.req_id in out.sampled and c.req_id in wanted
                    for s in [self.requests[c.req_id]]])
        return out

    def _sample(self, so: SchedulerOutput, chunks: list[ScheduledChunk], hidden: torch.Tensor,
                rows_only: bool = False):
        """The logits of the rows that need them, sampled (and proposed tokens verified), and prompt
        logprobs. rows_only: hidden holds those rows alone (the last layer finished no others).
        -> the step's result on the rank that samples, None on the other TP ranks."""
        needed = self.step_builder.logits_rows(chunks)
        rows, sample_chunks, prompt_rows = needed.rows, needed.sample_chunks, needed.prompt_rows
        if not rows:
            # only unfinished prompt chunks (a prompt longer than the step's token budget is
            # prefilled over several steps): no logits needed, nothing to sample. Every TP rank
            # of the stage sees the same chunks, so they all skip the LM head's collectives.
            return ModelRunnerOutput({})
        if not rows_only:
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]
        states = [self.requests[c.req_id] for c in sample_chunks]
        allowed = self._allowed_tokens(so, sample_chunks)
        if sample_chunks and not prompt_rows and self._greedy_on_vocab_shards(states):
            # each TP rank sends its (max, index) per row instead of its logits
            tokens = self.model.lm_head.greedy(hidden, allowed)
            return self._record(sample_chunks, states, tokens, {}) if tokens is not None else None
        logits = self.model.compute_logits(hidden)
        if logits is None:                  # not the rank that samples
            return None
        out = ModelRunnerOutput({})
        if sample_chunks and self.logits_processors is not None:
            out = self._sample_with_processors(logits, sample_chunks, states, allowed)
        elif sample_chunks:
            row_states = self.step_builder.sampling_states(sample_chunks)
            mask = allowed(0) if allowed is not None else None
            try:
                tokens, logprobs = self._sample_rows(logits[:len(row_states)], row_states, mask)
                out = self._record(sample_chunks, states, tokens, logprobs)
            except Exception as fault:      # noqa: BLE001 - whose fault it is decides what ends
                out = self._sample_each(logits, sample_chunks, states, row_states, mask, fault)
        self._prompt_logprobs(logits, prompt_rows, out)
        return out

    def _sample_rows(self, logits: torch.Tensor, row_states: list[RequestState], mask: TokenBitmask | None,
                     processors: tuple[list, list] = ([], [])):
        batch = self._sampling_batch(row_states)
        batch.allowed = mask
        batch.processors_first, batch.processors_after_temperature = processors
        return self.sampler(logits, batch)

    def _sample_with_processors(self, logits, sample_chunks, states, allowed) -> ModelRunnerOutput:
        """Sampling through the custom logits processors (one row per request: speculative
        decoding refuses them). They see the whole batch, so a step whose sampling raises cannot be
        sampled again request by request: each of its requests ends with the error."""
        try:
            processors = self.logits_processors.prepare([c.req_id for c in sample_chunks], self.requests)
            tokens, logprobs = self._sample_rows(logits[:len(states)], states,
                                                 allowed(0) if allowed is not None else None, processors)
        except Exception as e:      # noqa: BLE001 - the requests end with it; the engine goes on
            logger.exception("Sampling a step of %d request(s) with the logits processors %s failed",
                             len(sample_chunks), self.logits_processors.names)
            why = f"sampling failed in the logits processors {self.logits_processors.names} ({type(e).__name__}: {e})"
            return ModelRunnerOutput({}, failed={c.req_id: why for c in sample_chunks})
        return self._record(sample_chunks, states, tokens, logprobs)

    def _sample_each(self, logits, sample_chunks, states, row_states, mask, fault: Exception) -> ModelRunnerOutput:
        """The step's sampling raised: each request sampled alone. One that raises alone ends with
        its error (its own parameters, bias or grammar caused it) and the others keep their tokens,
        as they would have had them without it. When every request of several fails alone, the
        fault is the step's, not a request's: raised (the engine restarts)."""
        logger.exception("Sampling a step of %d request(s) failed; sampling each alone", len(sample_chunks))
        out, row = ModelRunnerOutput({}), 0
        for c, state in zip(sample_chunks, states):
            end = row + 1 + c.num_draft_tokens
            try:
                own_mask = mask.rows_between(row, end) if mask is not None else None
                tokens, logprobs = self._sample_rows(logits[row:end], row_states[row:end], own_mask)
            except Exception as e:      # noqa: BLE001
                out.failed[c.req_id] = f"sampling failed ({type(e).__name__}: {e})"
            else:
                own = self._record([c], [state], tokens, logprobs)
                out.sampled.update(own.sampled)
                out.logprobs.update(own.logprobs)
            row = end
        if len(sample_chunks) > 1 and len(out.failed) == len(sample_chunks):
            raise fault
        return out

    def _allowed_tokens(self, so: SchedulerOutput, sample_chunks: list[ScheduledChunk]):
        """Structured outputs: a function (first token of the logits' columns) -> TokenBitmask of
        the constrained rows among sample_chunks, or None when none is constrained."""
        if not so.grammar_req_ids:
            return None
        rows = torch.tensor(StepBuilder.grammar_rows(so.grammar_req_ids, sample_chunks), dtype=torch.long,
                            device=self.device)
        words = np.frombuffer(so.grammar_bitmask, dtype=np.int32).reshape(len(rows), -1)
        return lambda first_token: TokenBitmask(rows, words, first_token)

    def _greedy_on_vocab_shards(self, states: list[RequestState]) -> bool:
        """TP: every row is a plain argmax (what Sampler does for them), decided from the requests'
        parameters alone so that every rank agrees (only the sampling rank tracks output tokens)."""
        if self.logits_processors is not None:       # a custom processor sees whole rows of logits
            return False
        return self.tp.world_size > 1 and hasattr(getattr(self.model, "lm_head", None), "greedy") and all(
            p.greedy and not p.uses_penalties and p.logprobs is None and not p.logit_bias
            and p.allowed_token_ids is None and p.min_tokens == 0 and not p.bad_words_token_ids
            for p in (s.sampling_params for s in states))

    @torch.inference_mode()
    def execute_dummy(self) -> int:
        """DP + EP lock-step: run this rank's MoE layers with no tokens of its own, so the other
        replicas' tokens reach its experts. -> the tokens all replicas had in this step."""
        with dp_token_counts(self._tokens_per_replica(0)) as counts:
            if sum(counts):
                for layer in self.moe_layers().values():
                    layer.dummy_forward()
                if self.balancer is not None:
                    self.balancer.after_forward()
        return sum(counts)

    def _tokens_per_replica(self, num_tokens: int) -> list[int] | None:
        """Each DP replica's tokens in this step (one small all-gather), when their MoE layers run together."""
        if not self.dp_lockstep:
            return None
        return get_dp_group().all_gather(torch.tensor([num_tokens], device=self.device), dim=0).tolist()

    def _update_requests(self, so: SchedulerOutput) -> None:
        """Forget finished requests; remember new ones (with their own generator when seeded)."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            if self.proposer is not None:
                self.proposer.forget(req_id)
        for new in so.new_requests:
            sp = new.sampling_params
            gen = None
            if sp.seed is not None and not sp.greedy:
                gen = torch.Generator(device=self.device).manual_seed(sp.seed)
            lora = new.lora_request
            if lora is not None:
                self.lora.register(lora)
            self.requests[new.req_id] = RequestState(new.prompt_token_ids, sp, gen, lora.lora_int_id if lora else 0,
                                                     pooling_params=new.pooling_params,
                                                     token_type_ids=new.token_type_ids, mm_items=new.mm_items)

    def _prepare_inputs(self, batch: StepBatch):
        """The tensors and attention metadata of the tokens this rank computes."""
        if getattr(self.model, "is_encoder", False):       # whole prompts, no KV cache
            return (torch.tensor(batch.computed_ids, dtype=torch.long, device=self.device),
                    torch.tensor(batch.computed_positions, dtype=torch.long, device=self.device),
                    self._encoder_batch(batch.chunks))
        self._fault_in_blocks(max(max(t) for c in batch.chunks for t in c.block_tables))
        layout = batch.attention
        pcp = batch.pcp.step if batch.pcp is not None else None
        metas = [backend.build_metadata(layout.query_lens, layout.starts, layout.tables_of(g), pcp)
                 for g, backend in enumerate(self.attn_backends)]
        meta = metas[0] if len(metas) == 1 else KVGroupsMetadata(metas)
        last = self._last_layer_rows(batch) if self._finishes_rows else None
        if last is not None:
            meta.last_layer = last
        return (torch.tensor(batch.computed_ids, dtype=torch.long, device=self.device),
                torch.tensor(batch.computed_positions, dtype=torch.long, device=self.device), meta)

    def _image_embeddings(self, batch: StepBatch) -> image_embeddings.StepEmbeddings | None:
        """The step's given embeddings (images', prompts'), on the first stage (multimodal/)."""
        if not self.pp.is_first_rank or not any(self.requests[c.req_id].mm_items for c in batch.chunks):
            return None
        mm = self.config.model.multimodal
        return image_embeddings.of_step(batch, self.requests, self.vision, mm.image_token_id if mm else None,
                                        self.device)

    def _last_layer_rows(self, batch: StepBatch) -> LastLayerRows | None:
        """The rows the model's last layer finishes where the step reads fewer final hidden states
        than it has rows (a prompt chunk's last token alone): that layer still writes every row's
        K/V, but attends, projects and runs its MLP for those rows only (about 1/layers of a long
        prompt's time). The rows are attended by the kernels that attend them in the whole step,
        so their numbers are unchanged. None: every row (a request wants prompt logprobs, or an
        adapter's tokens are laid out over all the rows)."""
        if batch.lora is not None or any(self.requests[c.req_id].sampling_params.prompt_logprobs is not None
                                         for c in batch.chunks):
            return None
        sampled = self.step_builder.sampled_rows(batch.chunks)
        if len(sampled.rows) == len(batch.input_ids):
            return None
        meta = self.attn_backend.build_rows_metadata(sampled.attention.starts, sampled.attention.tables_of(0),
                                                     sampled.prompt)
        return LastLayerRows(torch.tensor(sampled.rows, dtype=torch.long, device=self.device), meta) \
            if meta is not None else None

    def _encoder_batch(self, chunks: list[ScheduledChunk]) -> EncoderBatch:
        types = []
        for c in chunks:
            given = self.requests[c.req_id].token_type_ids
            types.extend(given if given is not None else [0] * len(c.token_ids))
        return EncoderBatch([len(c.token_ids) for c in chunks],
                            torch.tensor(types, dtype=torch.long, device=self.device))

    def _gather_pcp_hidden(self, hidden: torch.Tensor, groups: list[list[int]]) -> torch.Tensor | None:
        """The final hidden states of the whole step, in step order, on the first PCP group (None
        on the others): each group's rows (groups: their tokens) gathered, padded to the longest."""
        padded = hidden.new_zeros(max(len(g) for g in groups), hidden.shape[-1])
        padded[:hidden.shape[0]] = hidden
        every = self.pcp.gather(padded.unsqueeze(0), dst=0, dim=0)
        if every is None:
            return None
        full = hidden.new_empty(sum(len(g) for g in groups), hidden.shape[-1])
        for p, tokens in enumerate(groups):
            if tokens:
                full[torch.tensor(tokens, device=self.device)] = every[p, :len(tokens)]
        return full

    def _run_model(self, input_ids, positions, meta):
        """This rank's layers; between pipeline stages, the hidden states come in and go out.
        -> the final hidden states on the last stage, None on the others."""
        # graphs finish every row, and embed tokens inside: not for a step with given embeddings
        if self.use_cuda_graphs and getattr(meta, "last_layer", None) is None and image_embeddings.current() is None:
            hidden = self.cuda_graphs.run(input_ids, positions, meta)
            if hidden is not None:
                return hidden
        intermediate = None if self.pp.is_first_rank else self._receive_from_previous_stage()
        hidden = self.model(input_ids, positions, meta, intermediate)
        if not self.pp.is_last_rank:
            self._send_to_next_stage(hidden)
            return None
        return hidden

    def _record(self, sample_chunks: list[ScheduledChunk], states: list[RequestState], tokens: list[int],
                logprobs: dict) -> ModelRunnerOutput:
        """The step's new tokens (and logprobs), remembered for penalties and min_tokens: per
        request, the proposed tokens the sampled ones confirm and one more. tokens, logprobs:
        per sampled row (_row_states)."""
        out = ModelRunnerOutput({})
        row = 0
        for c, state in zip(sample_chunks, states):
            new = accepted_tokens(tokens[row:row + 1 + c.num_draft_tokens], c.draft_token_ids)
            state.output_token_ids.extend(new)
            out.sampled[c.req_id] = new
            if row in logprobs:
                out.logprobs[c.req_id] = [logprobs[row + j] for j in range(len(new))]
            row += 1 + c.num_draft_tokens
        return out

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_rows, out: ModelRunnerOutput) -> None:
        for req_id, first_pos, first_row, n in prompt_rows:
            state = self.requests[req_id]
            lps = self.sampler.values(logits[first_row:first_row + n])    # nothing processes prompt positions
            k = state.sampling_params.prompt_logprobs
            targets = state.prompt_token_ids[first_pos + 1:first_pos + 1 + n]
            out.prompt_logprobs[req_id] = [token_logprobs(lps[i], t, k) for i, t in enumerate(targets)]

    # ---- between pipeline stages: hidden states and residual ----
    def _split_across_tp(self) -> bool:
        """Each TP rank sends its 1/tp slice of the hidden dimension and the next stage's TP
        ranks all-gather it: tp links carry 1/tp of the traffic each."""
        return self.tp.world_size > 1 and self.config.model.hf_config.hidden_size % self.tp.world_size == 0

    def _send_to_next_stage(self, tensors: list[torch.Tensor]) -> None:
        if self._split_across_tp():
            tensors = [t.chunk(self.tp.world_size, dim=-1)[self.tp.rank_in_group] for t in tensors]
        self.pp.send_tensors(tensors, dst=self.pp.rank_in_group + 1)

    def _receive_from_previous_stage(self) -> list[torch.Tensor]:
        tensors = self.pp.recv_tensors(src=self.pp.rank_in_group - 1, device=self.device)
        if self._split_across_tp():
            tensors = [self.tp.all_gather(t, dim=-1) for t in tensors]
        return tensors

    def _fault_in_blocks(self, top_block: int) -> None:
        """Touch KV memory ahead of use, in large sequential chunks.

        The CPU cache is faulted in lazily by the OS; faults taken one page at a time inside
        attention cost ~16 us each on a VM (10-15% of a decode step), while touching whole
        ranges costs ~0.2 s per GiB. Fresh blocks are handed out in increasing id order, so one
        high-water mark tells which memory is still untouched."""
        if top_block < self._faulted_blocks:
            return
        hi = min(self.num_blocks, max(top_block + 1, self._faulted_blocks + self._fault_chunk))
        for k_cache, v_cache in self._kv_tensors:
            k_cache[:, self._faulted_blocks:hi].zero_()
            v_cache[:, self._faulted_blocks:hi].zero_()
        self._faulted_blocks = hi

    def _sampling_batch(self, states: list[RequestState]) -> SamplingBatch:
        params = [s.sampling_params for s in states]
        dev = self.device
        batch = SamplingBatch(temperature=None, greedy=None)
        if not all(p.greedy for p in params):
            batch.temperature = torch.tensor([p.temperature for p in params], device=dev)
            batch.greedy = torch.tensor([p.greedy for p in params], device=dev)
            vocab = self.config.model.vocab_size
            if any(p.top_k > 0 for p in params):
                batch.top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
            if any(p.top_p < 1 for p in params):
                batch.top_p = torch.tensor([p.top_p for p in params], device=dev)
            if any(p.min_p > 0 for p in params):
                batch.min_p = torch.tensor([p.min_p for p in params], device=dev)
            batch.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        if any(p.uses_penalties for p in params):
            batch.penalties = (torch.tensor([p.presence_penalty for p in params], device=dev),
                               torch.tensor([p.frequency_penalty for p in params], device=dev),
                               torch.tensor([p.repetition_penalty for p in params], device=dev),
                               [s.prompt_token_ids if s.sampling_params.repetition_penalty != 1.0 else []
                                for s in states],
                               [s.output_token_ids for s in states])
        banned = []
        for i, (s, p) in enumerate(zip(states, params)):
            if len(s.output_token_ids) < p.min_tokens:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else self.stop_ids_for_min_tokens)
                if ids:
                    banned.append((i, ids))
            if p.bad_words_token_ids:
                banned.append((i, completing_bad_words(s.output_token_ids, p.bad_words_token_ids)))
        batch.banned = banned or None
        biases = [(i, p.logit_bias, p.allowed_token_ids) for i, p in enumerate(params)
                  if p.logit_bias or p.allowed_token_ids is not None]
        batch.biases = biases or None
        if any(p.logprobs is not None for p in params):
            batch.logprobs_k = [p.logprobs for p in params]
        return batch
