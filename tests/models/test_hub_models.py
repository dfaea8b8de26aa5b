"""Models named by hub id, resolved from a cache laid out as huggingface_hub lays it out (this
machine cannot reach the hub; the download path is huggingface_hub's own): a revision by
branch, tag or commit, a GGUF file of a repo, a tokenizer by hub id, and the clear error for a
model that is neither here nor in the cache."""

import hashlib
import os
import shutil

import pytest

from shardlm import LLM, SamplingParams
from shardlm.model_loader import hub
from shardlm.model_loader.default_model import gguf_source, resolve_model_path, resolve_tokenizer_path

MAIN, V1 = "a" * 40, "b" * 40        # commit hashes


def add_snapshot(cache, repo: str, commit: str, files: dict[str, str], refs: tuple[str, ...] = ()) -> str:
    """Files (name -> source path) as huggingface_hub stores them: content-addressed blobs,
    symlinked from snapshots/<commit>/, with refs/<name> holding the commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        digest = hashlib.sha256(open(src, "rb").read()).hexdigest()
        blob = root / "blobs" / digest
        if not blob.exists():
            shutil.copy(src, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    for ref in refs:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return str(snapshot)


@pytest.fixture
def hub_cache(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    model = tiny_model_dir("llama-gqa")
    files = {f: os.path.join(model, f) for f in os.listdir(model) if os.path.isfile(os.path.join(model, f))}
    main = add_snapshot(cache, "acme/tiny", MAIN, files, refs=("main",))
    v1 = add_snapshot(cache, "acme/tiny", V1, {k: v for k, v in files.items()}, refs=("v1",))
    return cache, model, main, v1


def test_a_hub_id_resolves_to_its_snapshot_by_branch_tag_or_commit(hub_cache):
    cache, _, main, v1 = hub_cache
    assert resolve_model_path("acme/tiny", str(cache)) == main
    assert resolve_model_path("acme/tiny", str(cache), revision="v1") == v1
    assert resolve_model_path("acme/tiny", str(cache), revision=V1) == v1
    assert resolve_tokenizer_path("acme/tiny", str(cache)) == main


def test_an_engine_serves_a_hub_id_as_it_serves_the_directory(hub_cache):
    cache, model, _, _ = hub_cache
    params = SamplingParams(temperature=0, max_tokens=8)
    engine = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=256)
    by_id = LLM("acme/tiny", download_dir=str(cache), revision="v1", **engine)
    try:
        got = by_id.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        by_id.shutdown()
    local = LLM(model, **engine)
    try:
        assert got == local.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        local.shutdown()


def test_one_gguf_file_of_a_repo(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gguf = tmp_path / "model-Q4_1.gguf"
    gguf.write_bytes(b"GGUF not really")
    add_snapshot(tmp_path / "hub", "acme/tiny-GGUF", MAIN, {"model-Q4_1.gguf": str(gguf)}, refs=("main",))
    found = gguf_source("acme/tiny-GGUF:model-Q4_1.gguf", str(tmp_path / "hub"))
    assert found.endswith("model-Q4_1.gguf") and open(found, "rb").read() == b"GGUF not really"


def test_hf_config_path_by_hub_id_takes_the_repos_config_json(hub_cache):
    """--hf-config-path acme/tiny: the directory of that repo's config.json (fetched alone)."""
    cache, _, main, v1 = hub_cache
    assert hub.config_dir("acme/tiny", None, str(cache)) == main
    assert hub.config_dir("acme/tiny", "v1", str(cache)) == v1
    with pytest.raises(ValueError, match="'acme/other:config.json'.*not in the hub cache"):
        hub.config_dir("acme/other", None, str(cache))


def test_a_model_neither_here_nor_cached_is_one_clear_error(hub_cache):
    cache = hub_cache[0]
    with pytest.raises(ValueError, match=r"'acme/other' is not a local directory, and not in the hub cache .*"
                                         r"HF_HUB_OFFLINE.*huggingface-cli download acme/other"):
        resolve_model_path("acme/other", str(cache))
    with pytest.raises(ValueError, match="revision 'v9'"):
        resolve_model_path("acme/tiny", str(cache), revision="v9")
    with pytest.raises(ValueError, match="not a local directory, a .gguf file or a hub id"):
        resolve_model_path("./no/such/dir")
    assert not hub.looks_like_hub_id("../escape") and hub.looks_like_hub_id("org/name")


def test_a_node_without_the_heads_path_fetches_the_hub_model_itself(hub_cache, tmp_path):
    """Ray nodes: the head's snapshot path missing on a node, the node resolves the hub id into
    its own cache (here: the prepared one); with no hub id, the node has no model."""
    cache, _, main, _ = hub_cache
    elsewhere = str(tmp_path / "head-only" / "snapshot")
    assert hub.model_on_this_node(main, None) == main                       # shared path: as it is
    assert hub.model_on_this_node(elsewhere, ("acme/tiny", None, str(cache))) == main
    assert hub.model_on_this_node(elsewhere, None) is None
    with pytest.raises(ValueError, match="not in the hub cache"):
        hub.model_on_this_node(elsewhere, ("acme/other", None, str(cache)))


def test_the_engine_config_remembers_a_hub_source(hub_cache):
    from shardlm.engine.arg_utils import EngineArgs
    cache, model, _, _ = hub_cache
    by_id = EngineArgs("acme/tiny", download_dir=str(cache), revision="v1",
                       kv_cache_memory="64MiB").create_engine_config()
    assert by_id.model.hub_source == ("acme/tiny", "v1", str(cache))
    assert EngineArgs(model, kv_cache_memory="64MiB").create_engine_config().model.hub_source is None


def test_hf_token_is_the_token_huggingface_hub_uses_and_tokenizer_modes(hub_cache, monkeypatch):
    """--hf-token TOKEN (vLLM's) is huggingface_hub's token in this process and those it starts;
    alone, the stored one. --tokenizer-mode: auto or hf; another is refused, saying why."""
    import argparse

    import huggingface_hub

    from shardlm.engine.arg_utils import EngineArgs
    from shardlm.entrypoints.cli.engine_flags import add_engine_args
    cache, _, _, _ = hub_cache
    monkeypatch.setenv("HF_TOKEN", "hf_before")          # restored after the test
    EngineArgs(model="acme/tiny", download_dir=str(cache), hf_token="hf_given").create_engine_config()
    assert huggingface_hub.get_token() == "hf_given"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--hf-token"]).hf_token is True
    assert parser.parse_args(["--hf-token", "hf_x"]).hf_token == "hf_x"
    assert EngineArgs(model="acme/tiny", download_dir=str(cache), tokenizer_mode="hf").create_engine_config()
    with pytest.raises(ValueError, match="--tokenizer-mode 'mistral'"):
        EngineArgs(model="acme/tiny", download_dir=str(cache), tokenizer_mode="mistral").create_engine_config()
