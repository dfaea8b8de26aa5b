import pytest

from shardlm import SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-3), "top_k"),
    (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=100), "logprobs"),
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
