"""Property-based fuzz of the request bodies (hypothesis, bounded in count and time, loopback
only): whatever a client sends, the server answers below 500 and keeps serving."""

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.test_openai_server import _start, _stop

FIELDS = ["model", "prompt", "messages", "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
          "min_tokens", "stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "logprobs", "top_logprobs",
          "echo", "stream", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
          "include_stop_str_in_output", "skip_special_tokens", "stream_options", "best_of", "user", "suffix"]

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**70, max_value=2**70), st.sampled_from([0, 1, 2, 5, 49151, 49152, 2**63, -1]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 1e308, -1e-300]),
    st.text(max_size=20), st.sampled_from(["\ud800", "tiny", "", "x" * 300]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                      max_leaves=8)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    proc, url = _start(tiny_model_dir("llama-gqa"), "--max-n", "4", "--max-prompts", "4")
    yield proc, url
    _stop(proc)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=bodies, chat=st.booleans())
def test_no_request_body_gets_a_5xx(server, body, chat):
    proc, url = server
    body.setdefault("model", "tiny")
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8                    # keep the valid ones short
    body.setdefault("max_tokens", 4)
    try:
        r = httpx.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=60)
    except ValueError:                            # httpx cannot even encode it (NaN in JSON is fine, this is not)
        return
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.json()["error"]["code"] == r.status_code
    assert proc.poll() is None
