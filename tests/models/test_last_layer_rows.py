"""The last layer finishes only the rows whose logits are read (model_runner: _last_layer_rows):
every row's K/V is still cached, and the sampled rows' tokens and log-probabilities are those of
the whole layer: bit for bit with shardlm's C attention kernels, to rounding on the torch path
(sliding windows). On prompt chunks alone, on steps of decodes and prompt chunks together, on
chunks that sample nothing (a long prompt over several steps); dense and MoE layers."""

import pytest

from shardlm import LLM, SamplingParams
from shardlm.worker.model_runner import ModelRunner

# a long prompt split over steps of 48 tokens; short ones that decode beside its chunks
PROMPTS = [[(37 * i) % 3000 + 100 for i in range(150)], [101, 2054, 2003, 1037], [7592, 1010, 2088, 999, 102] * 4]


def _runs(llm) -> dict[bool, list]:
    """Each sequence's tokens and log-probabilities with the last layer finishing only the sampled
    rows (True) and every row (False)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    results = {}
    for finish_rows in (True, False):
        ModelRunner._finish_rows_test_switch = finish_rows
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        results[finish_rows] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    return results


@pytest.fixture
def switchable(monkeypatch):
    """ModelRunner._last_layer_rows, off where the test says; -> the rows each call finished."""
    finished = []
    original = ModelRunner._last_layer_rows

    def rows(self, batch):
        last = original(self, batch) if ModelRunner._finish_rows_test_switch else None
        finished.append(None if last is None else last.rows.tolist())
        return last

    monkeypatch.setattr(ModelRunner, "_last_layer_rows", rows)
    monkeypatch.setattr(ModelRunner, "_finish_rows_test_switch", True, raising=False)
    return finished


@pytest.mark.parametrize("name, dtype", [("llama-gqa", "float32"), ("llama-gqa", "bfloat16"), ("qwen3", "bfloat16"),
                                         ("mistral-window", "float32"),    # windows: the torch attention path
                                         pytest.param("mixtral", "bfloat16", marks=pytest.mark.slow),
                                         pytest.param("granite", "float32", marks=pytest.mark.slow)])
def test_finishing_the_sampled_rows_alone_changes_no_number(name, dtype, tiny_model_dir, switchable):
    llm = LLM(tiny_model_dir(name), dtype=dtype, kv_cache_memory="64MiB", enable_prefix_caching=False,
              max_num_batched_tokens=48, distributed_executor_backend="uni")
    try:
        results = _runs(llm)
    finally:
        llm.shutdown()
    if name != "mistral-window":
        assert results[True] == results[False]
    else:       # torch's attention of one query may round otherwise than among its chunk's (as chunking does)
        for (tokens, logprobs), (all_tokens, all_logprobs) in zip(results[True], results[False]):
            assert tokens == all_tokens
            for step, all_step in zip(logprobs, all_logprobs):
                assert step.keys() == all_step.keys()
                assert all(abs(step[t].logprob - all_step[t].logprob) < 1e-5 for t in step)
    half = len(switchable) // 2
    trimmed = [rows for rows in switchable[:half] if rows is not None]
    assert [] in trimmed, "a chunk of the long prompt that samples nothing should finish no row"
    assert any(len(rows) > 1 for rows in trimmed), "a step of decodes and a prompt chunk should finish their rows"
    assert not any(switchable[half:])
