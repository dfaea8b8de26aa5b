"""The CPU plan (shardlm/cpu_plan.py): every CPU choice of a run in one value, written where
--cpu-plan names a new file and followed, without timing anything, where it names one written
before; a file that is not a plan is refused with what to do."""

import json

import pytest

from shardlm import LLM, SamplingParams, cpu_plan, kernels
from shardlm.layers import cpu_dtype, cpu_matmul


@pytest.fixture
def fresh_plan():
    cpu_plan.forget()
    kernels.use_isa(kernels._isa_cap[0])        # the bfloat16 product choice is made again
    yield
    cpu_plan.forget()
    kernels.use_isa(kernels._isa_cap[0])


def test_a_given_plan_answers_without_measuring(tmp_path, fresh_plan):
    path = tmp_path / "plan.json"
    path.write_text(cpu_plan.CpuPlan(choices={"skinny_rows": {"[8, 4] float32": 16}}).to_json())
    cpu_plan.follow(str(path))

    def measure():
        raise AssertionError("a choice the plan gives is not measured")
    assert cpu_plan.choose("skinny_rows", "[8, 4] float32", measure) == 16
    assert cpu_plan.choose("skinny_rows", "[8, 8] float32", lambda: (4, "timed")) == 4     # not in the file
    made = cpu_plan.current()
    assert made.evidence["skinny_rows"] == {"[8, 4] float32": f"from {path}", "[8, 8] float32": "timed"}
    assert cpu_plan.CpuPlan.from_json(made.to_json()) == made


def test_a_file_that_is_not_a_plan_is_refused_with_what_to_do(tmp_path, fresh_plan):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"model": "x"}))
    with pytest.raises(ValueError, match="give a plan that shardlm wrote, or a path where none exists yet"):
        cpu_plan.follow(str(path))


@pytest.mark.slow
def test_a_run_writes_its_plan_and_the_next_follows_it_exactly(tiny_model_dir, tmp_path, fresh_plan, monkeypatch):
    path = tmp_path / "plan.json"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [101, 2054, 2003, 1037]}]
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="bfloat16", kv_cache_memory="64MiB", cpu_plan=str(path))
    first = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    written = cpu_plan.CpuPlan.from_json(path.read_text())
    assert written.dtype == "bfloat16" and written.isa == kernels.active_isa()
    expected_path = "in one C call" if kernels.llama_decode_layers() is not None else "layer by layer"
    assert written.decode_path.startswith(expected_path)

    cpu_plan.forget()
    kernels.use_isa(kernels._isa_cap[0])

    def no_timing(*args, **kwargs):
        raise AssertionError("a run that follows a plan times nothing")
    monkeypatch.setattr(cpu_matmul, "rows_kernel_wins", no_timing)
    monkeypatch.setattr(kernels, "_time_bf16_dot", no_timing)
    monkeypatch.setattr(cpu_dtype, "measure", no_timing)
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="bfloat16", kv_cache_memory="64MiB", cpu_plan=str(path))
    again = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    followed = cpu_plan.current()
    assert followed.choices == written.choices and again == first
    assert all(how == f"from {path}" for kind in followed.evidence.values() for how in kind.values())


@pytest.mark.parametrize("rounds, pays", [([(1.0, 1.0), (2.0, 1.0)], True), ([(1.0, 1.0)] * 3, False)])
def test_the_bf16_dot_product_is_timed_again_when_a_round_shows_no_gain(monkeypatch, rounds, pays):
    """A slow spell of a noisy machine once made one round's medians equal on an AMD Zen 4, where the
    dot product takes half the time: up to three rounds, the first showing the gain deciding."""
    from shardlm import utils
    if kernels.blocked_matmul() is None:
        pytest.skip("no blocked kernel in this variant")
    given = iter(rounds)
    calls = []

    def side_by_side(a, b, reps):
        calls.append(reps)
        return next(given)
    monkeypatch.setattr(utils, "median_seconds_side_by_side", side_by_side)
    chosen, how = kernels._time_bf16_dot(lambda on: None, lambda *args: None)
    assert chosen is pays and len(calls) == len(rounds)
