"""Hugging Face transformers as the correctness reference, and the comparison rule:
outputs equal, or where they diverge each side's token is in the other's top-5 logprobs
(after which that sequence is not compared further)."""

from __future__ import annotations

import torch


def greedy(model_dir: str, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype = torch.float32,
           device: str = "cpu", batched: bool = False) -> list[tuple[list[int], list[set[int]]]]:
    """Per prompt: generated ids and the top-5 ids at every step. Attention is transformers'
    eager implementation, the one every model has whole (its SDPA path dropped Gemma 2's
    soft-capping in some versions). One prompt at a time (no padding), or with batched all in one
    left-padded batch (the attention mask gives transformers the positions): 4x faster for the
    default model's 8 prompts, whose tokens and top-5 sets it leaves as they were; a batch's
    products may round otherwise, so a near-tie of a random tiny model could go the other way."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").to(device).eval()
    groups = [prompts] if batched else [[ids] for ids in prompts]
    results = []
    with torch.inference_mode():
        for group in groups:
            width = max(map(len, group))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device=device)
            padded = {"attention_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group],
                                                     device=device)} if batched else {}
            out = model.generate(ids, **padded, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True,
                                 eos_token_id=None, pad_token_id=0)
            for i in range(len(group)):
                gen = out.sequences[i, width:].tolist()
                top5 = [set(s[i].topk(5).indices.tolist()) for s in out.scores]
                results.append((gen, top5))
    return results


def top5_sets(completion) -> list[set[int]]:
    return [{t for t, lp in d.items() if lp.rank <= 5} for d in completion.logprobs]


def assert_close(ref: list[tuple[list[int], list[set[int]]]], ours, label: str = "") -> int:
    """ours: RequestOutputs with logprobs>=5. Returns how many sequences matched exactly."""
    exact = 0
    for i, ((ref_ids, ref_top), out) in enumerate(zip(ref, ours)):
        comp = out.outputs[0]
        our_ids, our_top = comp.token_ids, top5_sets(comp)
        assert len(our_ids) == len(ref_ids), f"{label} prompt {i}: {len(our_ids)} tokens vs HF {len(ref_ids)}"
        for pos, (a, b) in enumerate(zip(ref_ids, our_ids)):
            if a != b:
                assert a in our_top[pos] and b in ref_top[pos], (
                    f"{label} prompt {i} diverged at token {pos}: HF {a} (ours top-5 {our_top[pos]}), "
                    f"shardlm {b} (HF top-5 {ref_top[pos]})")
                break
        else:
            exact += 1
    return exact


def divergence_margins(ref, outs) -> list[float]:
    """Where our greedy token parts from HF's: how many nats our own logprobs put HF's token
    below ours (a near-tie when small). ours: RequestOutputs with logprobs >= 5 (assert_close
    has checked HF's token is among them)."""
    margins = []
    for (ref_ids, _), out in zip(ref, outs):
        comp = out.outputs[0]
        for pos, (a, b) in enumerate(zip(ref_ids, comp.token_ids)):
            if a != b:
                margins.append(comp.logprobs[pos][b].logprob - comp.logprobs[pos][a].logprob)
                break
    return margins
