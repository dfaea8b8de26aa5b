"""Streaming by deltas: the output processor's DELTA outputs, concatenated, are the FINAL_ONLY
output and the last CUMULATIVE one, with stop strings and multi-byte characters."""

import pytest

from shardlm.engine.output_processor import OutputProcessor, ParentRequest
from shardlm.messages import EngineCoreOutput, TokenLogprobs
from shardlm.outputs import RequestMetrics
from shardlm.sampling_params import RequestOutputKind, SamplingParams

TEXTS = ["naïve café — 日本語のテキスト 🚀🎉 done and more words after it",
         " one two three four five six seven",
         "emoji 🎉🎉🎉 then STOP here, and never this"]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model_dir)


def _run(tokenizer, kind, token_streams, per_step, **params):
    """Feed each sample's tokens `per_step` at a time, as the engine core would; every output."""
    proc = OutputProcessor(tokenizer)
    n = len(token_streams)
    sp = SamplingParams(n=n, output_kind=kind, logprobs=0, max_tokens=200, **params)
    prompt = tokenizer("Say:").input_ids
    parent = ParentRequest("r", "Say:", prompt, sp, RequestMetrics(0.0))
    child_ids = [f"{i}_r" for i in range(n)]
    proc.add_request(parent, child_ids, [sp.clone(n=1)] * n)
    outputs, pos, done = [], [0] * n, [False] * n
    while not all(done):
        step = []
        for i, ids in enumerate(token_streams):
            if done[i]:
                continue
            new = ids[pos[i]:pos[i] + per_step[i]]
            pos[i] += len(new)
            last = pos[i] >= len(ids)
            lps = [TokenLogprobs(t, -0.5, 1, [], []) for t in new]
            step.append(EngineCoreOutput(child_ids[i], new, lps, finish_reason="length" if last else None))
        processed = proc.process(step)
        for out in processed.request_outputs:
            outputs.append(out)
        # a sample that hit a stop string is aborted by the caller: it sends nothing more
        for i in range(n):
            sample = proc.samples.get(child_ids[i])
            done[i] = sample is None or sample.finished or pos[i] >= len(token_streams[i])
    assert not proc.has_unfinished()
    return outputs


@pytest.mark.parametrize("stop", [None, ["STOP"], ["three", "日本"]])
@pytest.mark.parametrize("per_step", [(1, 1, 1), (1, 3, 2)])
def test_concatenated_deltas_equal_final_output(tokenizer, stop, per_step):
    streams = [tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS]
    final = _run(tokenizer, RequestOutputKind.FINAL_ONLY, streams, per_step, stop=stop)
    cumulative = _run(tokenizer, RequestOutputKind.CUMULATIVE, streams, per_step, stop=stop)
    deltas = _run(tokenizer, RequestOutputKind.DELTA, streams, per_step, stop=stop)

    assert len(final) == 1 and final[0].finished
    assert cumulative[-1].finished and not any(o.finished for o in cumulative[:-1])
    assert len(deltas) > 3 and deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    for i, whole in enumerate(final[0].outputs):
        assert cumulative[-1].outputs[i].text == whole.text
        pieces = [c for o in deltas for c in o.outputs if c.index == i]
        assert "".join(c.text for c in pieces) == whole.text
        assert "\ufffd" not in "".join(c.text for c in pieces)
        assert [t for c in pieces for t in c.token_ids] == whole.token_ids
        assert sum(len(c.logprobs) for c in pieces) == len(whole.logprobs)
        assert pieces[-1].finish_reason == whole.finish_reason and pieces[-1].stop_reason == whole.stop_reason
        # no delta repeats text, and a delta names only what changed
        assert all(c.text or c.token_ids or c.finish_reason for c in pieces)
    if stop == ["STOP"]:
        assert final[0].outputs[2].text == "emoji 🎉🎉🎉 then " and final[0].outputs[2].stop_reason == "STOP"
    if stop == ["three", "日本"]:
        assert final[0].outputs[0].text == "naïve café — " and final[0].outputs[1].text == " one two "


def test_a_slow_reader_gets_missed_deltas_merged(tokenizer):
    from shardlm.engine.async_llm import RequestOutputCollector

    streams = [tokenizer(TEXTS[0], add_special_tokens=False).input_ids]
    deltas = _run(tokenizer, RequestOutputKind.DELTA, streams, (2,))
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    for d in deltas:
        collector.put(d)            # nobody read in between
    merged = collector.output
    assert merged.finished and merged.outputs[0].text == TEXTS[0]
    assert merged.outputs[0].token_ids == streams[0]
