"""Which features combine: the one table of the combinations this version refuses, and the one
function that checks a resolved configuration against it (run by EngineArgs before any process
starts). The README prints the same table (`python -m shardlm.engine.doc_tables`).

A rule names the two features as the user gives them (flags), says why they do not combine and
what to use instead; its test reads the resolved EngineConfig. Checks of one feature's own values
stay with that feature's config (config.py); what a model allows (heads, experts) stays with the
planner (planner/startup.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardlm.config import EngineConfig


class UnsupportedCombination(ValueError):
    """Two features asked for together that this version does not run together."""


@dataclass(frozen=True)
class Rule:
    combination: str                          # the features, as flags
    applies: Callable[[EngineConfig], bool]   # does the resolved config ask for it?
    reason: str
    instead: str

    def message(self) -> str:
        return f"{self.combination} is not supported in this version: {self.reason}. Instead: {self.instead}."


def _drafts_on_one_rank(c: EngineConfig) -> bool:
    return c.speculative is not None and c.speculative.method != "ngram"


def _reads_the_targets_layers(c: EngineConfig) -> bool:
    """An EAGLE head or MTP layer: built on the target's own layers and hidden states."""
    return c.speculative is not None and c.speculative.method not in ("ngram", "draft_model")


RULES: tuple[Rule, ...] = (
    Rule("--data-parallel-hybrid-lb or --data-parallel-rank for expert parallel replicas, with Ray "
         "(--data-parallel-backend ray, --distributed-executor-backend ray)",
         lambda c: c.parallel.data_parallel_hybrid_lb
         and "ray" in (c.parallel.data_parallel_backend, c.parallel.distributed_executor_backend),
         "each of those servers starts its own replicas, which meet the other servers' at the store of the server "
         "of replica 0, where Ray places every replica's ranks from one server",
         "the mp backend and executor on each node, or one server with -dp N on Ray (dense models' replicas behind "
         "their own servers take Ray: they never meet)"),
    Rule("--distributed-executor-backend ray with replicas on other nodes' servers (--headless, "
         "--data-parallel-size-local)",
         lambda c: c.parallel.distributed_executor_backend == "ray"
         and c.parallel.data_parallel_size_local < c.parallel.data_parallel_size,
         "with the ray executor, Ray places the ranks of every replica from the one server that runs their engine "
         "cores",
         "start one server with -dp N and the ray executor (the replicas' ranks go wherever the Ray cluster has "
         "room), or the mp executor on each node"),
    Rule("--enable-eplb without --enable-expert-parallel",
         lambda c: c.parallel.enable_eplb and not (c.parallel.enable_expert_parallel and c.model.num_experts > 0),
         "load balancing places whole experts over the ranks of expert parallel (a model without experts, or "
         "experts sliced by tensor parallel, has nothing to place)",
         "add --enable-expert-parallel for a mixture-of-experts model, or leave out --enable-eplb"),
)


def _transformers(c: EngineConfig) -> bool:
    return c.model.model_impl == "transformers"


RULES += (
    Rule("--model-impl transformers with -dcp or --enable-expert-parallel",
         lambda c: _transformers(c) and (c.parallel.decode_context_parallel_size > 1
                                         or c.parallel.enable_expert_parallel),
         "transformers' projections give each tensor parallel rank its own KV heads, where decode context parallel "
         "needs them replicated over the ranks that split a sequence's KV cache; its MoE modules run whole on each "
         "rank, so experts cannot be placed whole",
         "-tp (its linears split as the model's tensor parallel plan says), -pp, -pcp and -dp"),
    Rule("--model-impl transformers with a GGUF file or an EAGLE head or MTP layer",
         lambda c: _transformers(c) and ((c.model.quantization is not None and c.model.quantization.method == "gguf")
                                         or _reads_the_targets_layers(c)),
         "those read their tensors into shardlm's own model layout, which transformers' modeling code does not have",
         "a safetensors checkpoint (float, GPTQ, AWQ, FP8 or compressed-tensors; --quantization int8, int4 or "
         "fp8_* at load if you like); speculative decoding with method 'ngram' or a draft model"),
)


def _pooling(c: EngineConfig) -> bool:
    return c.model.runner == "pooling"


def _encoder(c: EngineConfig) -> bool:
    from shardlm.models.registry import get_model_class
    return getattr(get_model_class(c.model.architecture, c.model.convert, c.model.model_impl), "is_encoder", False)


RULES += (
    Rule("an encoder pooling model (BERT, RoBERTa, XLM-RoBERTa) with -pp",
         lambda c: _pooling(c) and c.parallel.pipeline_parallel_size > 1 and _encoder(c),
         "an encoder computes each prompt whole, without a KV cache, in layers that are not split into stages",
         "-tp or -dp (decoder embedders and rerankers take -pp)"),
    Rule("an encoder pooling model (BERT, RoBERTa, XLM-RoBERTa) with -dcp or -pcp",
         lambda c: _pooling(c) and c.parallel.context_parallel_size > 1 and _encoder(c),
         "an encoder keeps no KV cache to share over ranks: each prompt is computed whole where it is scheduled",
         "-tp or -dp"),
    Rule("--runner pooling with --speculative-config",
         lambda c: _pooling(c) and c.speculative is not None,
         "pooling requests generate no tokens, so there is nothing to propose",
         "leave out --speculative-config"),
    Rule("--enable-lora with an encoder pooling model (BERT, RoBERTa, XLM-RoBERTa)",
         lambda c: _pooling(c) and c.lora is not None and _encoder(c),
         "adapters apply to the layers of shardlm's decoders, and an encoder has its own",
         "a decoder embedding or classification model (e.g. Qwen3-Embedding), or leave out --enable-lora"),
)


def check_combinations(config: EngineConfig) -> None:
    """Raise UnsupportedCombination for the first rule this configuration breaks."""
    for rule in RULES:
        if rule.applies(config):
            raise UnsupportedCombination(rule.message())


def combinations_table() -> str:
    """The rules in markdown, as the README prints them."""
    rows = ["| asked for together | why not | instead |", "|---|---|---|"]
    rows += [f"| {r.combination} | {r.reason} | {r.instead} |" for r in RULES]
    return "\n".join(rows)


def _vision_language(c: EngineConfig) -> bool:
    return c.model.multimodal is not None


RULES += (
    Rule("--logits-processors with --speculative-config",
         lambda c: bool(c.model.logits_processors) and c.speculative is not None,
         "a custom processor sees one row per request, and a step verifying proposed tokens samples several",
         "one of the two"),
    Rule("--logits-processors with --runner pooling",
         lambda c: bool(c.model.logits_processors) and _pooling(c),
         "a pooling model samples no tokens, so there are no logits to process",
         "leave out --logits-processors"),
    Rule("a vision-language model (LLaVA) with a draft model or EAGLE head (--speculative-config method "
         "draft_model, eagle, eagle3, mtp)",
         lambda c: _vision_language(c) and _drafts_on_one_rank(c),
         "the draft would read an image's placeholder tokens as text: it is not given the images' embeddings",
         "speculative decoding with method 'ngram'"),
)
