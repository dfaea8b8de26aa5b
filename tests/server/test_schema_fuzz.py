"""Schema fuzzing, as vLLM's test_openai_schema.py does: schemathesis generates requests for every
operation of the live server's /openapi.json (valid ones and near misses) and none may get a 5xx.
Bounded here (a fixed seed, SHARDLM_FUZZ_EXAMPLES generated examples per operation, 5 by default,
beside the boundary cases of schemathesis' coverage phase: about 3,000 requests in all); at length
on demand: SHARDLM_FUZZ_EXAMPLES=1000 python -m pytest tests/server/test_schema_fuzz.py.

The server fuzzed generates little (generation_config.json's max_new_tokens 4, --max-model-len 64,
--max-n 4) so that the cases probe validation, not generation speed; each limit is a 400 to
reach, itself fuzzed."""

import json
import os
import shutil

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.helpers import start_server, stop_server

EXAMPLES = int(os.environ.get("SHARDLM_FUZZ_EXAMPLES", "5"))
CALLS: dict[str, int] = {}      # requests sent, per operation (printed at the end: run with -s)


@pytest.fixture(scope="module")
def fuzzed_server(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "model"
    shutil.copytree(tiny_model_dir("llama-gqa"), path)
    (path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4}))
    log = open(path.parent / "server.log", "w")      # it logs every request it fails
    proc, url = start_server(str(path), "--max-model-len", "64", "--max-n", "4", stderr=log)
    yield url
    print(f"\nschema fuzz: {sum(CALLS.values())} requests, no 5xx: {CALLS}")
    stop_server(proc)
    log.close()
    assert proc.returncode == 0


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(fuzzed_server + "/openapi.json")


# the pooling routes run on the pooling server below; here they would only repeat one 400
# (a generative server names --runner pooling: test_pooling_server.py)
POOLING_ROUTES = "embeddings|pooling|classify|score|rerank"
schema = schemathesis.pytest.from_fixture("api_schema").exclude(path_regex=POOLING_ROUTES)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error(case):
    response = case.call(timeout=60)
    CALLS[case.operation.label] = CALLS.get(case.operation.label, 0) + 1
    case.validate_response(response, checks=[not_a_server_error])


@pytest.fixture(scope="module")
def pooling_schema(minilm_dir):
    """A pooling server (all-MiniLM-L6-v2), for its own routes: they run the model here."""
    proc, url = start_server(minilm_dir, "--max-model-len", "64")
    yield schemathesis.openapi.from_url(url + "/openapi.json")
    pooled = {k: v for k, v in CALLS.items() if k.startswith("pooling ")}
    print(f"\nschema fuzz of a pooling server: {sum(pooled.values())} requests, no 5xx: {pooled}")
    stop_server(proc)
    assert proc.returncode == 0


pooling = schemathesis.pytest.from_fixture("pooling_schema").include(path_regex=POOLING_ROUTES)


@pytest.mark.slow
@pooling.parametrize()
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_pooling_request_gets_a_server_error(case):
    response = case.call(timeout=60)
    CALLS[f"pooling {case.operation.label}"] = CALLS.get(f"pooling {case.operation.label}", 0) + 1
    case.validate_response(response, checks=[not_a_server_error])
