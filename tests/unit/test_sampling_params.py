import pytest

from shardlm import SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-3), "top_k"),
    (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=-1), "logprobs"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(min_p=2), "min_p"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_parameter_lists_valid_ones():
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams(max_token=3)


def test_normalization():
    sp = SamplingParams(stop="x", temperature=0, top_k=-1, top_p=0.5)
    assert sp.stop == ["x"] and sp.greedy and sp.top_p == 1.0 and sp.top_k == 0
    assert sp.clone(seed=3).seed == 3 and sp.seed is None


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=float("nan")), "top_p"), (dict(min_p=float("-inf")), "min_p"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(temperature="hot"), "temperature"),
    (dict(top_k=2**63), "top_k"), (dict(seed=2**64), "seed"), (dict(seed=-1), "seed"), (dict(n=2**70), "n"),
    (dict(max_tokens=2**63), "max_tokens"), (dict(stop_token_ids=[2**64]), "stop_token_ids"),
    (dict(max_tokens=True), "max_tokens"), (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
])
def test_non_finite_and_out_of_range_values_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_token_ids_and_top_k_are_checked_against_the_vocabulary():
    ok = SamplingParams(stop_token_ids=[9], logit_bias={"3": -5}, allowed_token_ids=[0, 9], top_k=10)
    assert ok.logit_bias == {3: -5}
    ok.check_vocabulary(10)
    for kwargs, field in [(dict(stop_token_ids=[10]), "stop_token_ids"), (dict(logit_bias={10: 1}), "logit_bias"),
                          (dict(allowed_token_ids=[3, 12]), "allowed_token_ids"), (dict(top_k=11), "top_k")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs).check_vocabulary(10)
