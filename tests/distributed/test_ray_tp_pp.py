"""Ray executor with tp=2 inside each node and pp=2 across two nodes of two CPUs each: the
layout multi-node users run (TP = devices per node, PP = nodes)."""

import pytest

ray = pytest.importorskip("ray")

from shardlm import LLM  # noqa: E402
from shardlm.executor.ray_placement import check_placement  # noqa: E402
from tests.distributed.ray_cluster import assert_nothing_left, ray_cluster  # noqa: E402
from tests.distributed.test_executor_choice import VERSIONS, _node  # noqa: E402
from tests.models.test_tiny_models_vs_hf import PARAMS, _prompts  # noqa: E402


def test_the_placement_rule_keeps_tp_inside_nodes():
    """Two nodes of two ranks: tp=2 x pp=2 keeps each TP group on one node; tp=4 would span both
    and is refused unless forced (the rule the cluster test below runs under)."""
    ranks = [_node("A"), _node("A"), _node("B", "10.0.0.2", "b"), _node("B", "10.0.0.2", "b")]
    check_placement(ranks, tp=2, pp=2, model_path="/m", driver_versions=VERSIONS, allow_cross_node_tp=False)
    with pytest.raises(ValueError, match=r"ranks 0-3 would span 2 nodes.*ranks per node \(2 here\)"):
        check_placement(ranks, tp=4, pp=1, model_path="/m", driver_versions=VERSIONS, allow_cross_node_tp=False)
    check_placement(ranks, tp=4, pp=1, model_path="/m", driver_versions=VERSIONS, allow_cross_node_tp=True)


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(nodes=2, cpus_per_node=2) as c:
        yield c


@pytest.mark.slow
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
