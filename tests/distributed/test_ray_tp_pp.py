"""Ray executor with tp=2 inside each node and pp=2 across two nodes of two CPUs each: the
layout multi-node users run (TP = devices per node, PP = nodes)."""

import pytest

ray = pytest.importorskip("ray")

from shardlm import LLM  # noqa: E402
from tests.distributed.ray_cluster import assert_nothing_left, ray_cluster  # noqa: E402
from tests.models.test_tiny_models_vs_hf import PARAMS, _prompts  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(nodes=2, cpus_per_node=2) as c:
        yield c


def test_tp2_inside_nodes_pp2_across_nodes_matches_hf_and_mp(cluster, tiny_model_dir, references, hf):
    path = tiny_model_dir("llama-gqa")
    outs = {}
    for backend in ("ray", "mp"):
        llm = LLM(path, dtype="float32", kv_cache_memory="64MiB", tensor_parallel_size=2, pipeline_parallel_size=2,
                  distributed_executor_backend=backend)
        try:
            outs[backend] = llm.generate(_prompts(), PARAMS, use_tqdm=False)
            if backend == "ray":
                nodes = [info.node_id for info in llm.engine.engine_core.engine_core.executor.infos]
                assert nodes[0] == nodes[1] != nodes[2] == nodes[3], f"TP groups must not span nodes: {nodes}"
                assert nodes[0] == ray.get_runtime_context().get_node_id()
        finally:
            llm.shutdown()
    exact = hf.assert_close(references("llama-gqa"), outs["ray"], "ray tp=2 pp=2")
    assert exact >= 4, f"only {exact}/6 sequences equal HF exactly"
    assert [o.outputs[0].token_ids for o in outs["ray"]] == [o.outputs[0].token_ids for o in outs["mp"]]
    assert_nothing_left()
