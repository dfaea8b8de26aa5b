"""The `shardlm` command itself (each subcommand has tests of its own)."""

import json

import pytest

import shardlm
from shardlm.entrypoints.cli import main


def test_shardlm_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"shardlm {shardlm.__version__}\n"


def _parse(argv):
    from shardlm.entrypoints.cli import build_parser
    from shardlm.entrypoints.cli.config_file import expand_config_file
    parser = build_parser()
    return parser.parse_args(expand_config_file(parser, argv))


def test_config_file_flags_with_the_command_line_winning(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: /models/llama\ntensor_parallel_size: 2\nenable-prefix-caching: false\n"
                      "port: 9000\nmetrics-require-key: true\nlora-modules: [a=/l/a, b=/l/b]\n"
                      "speculative-config: {method: ngram, num_speculative_tokens: 3}\n"
                      "allowed-origins: [https://chat.example]\n")
    ns = _parse(["serve", "--config", str(config), "--port", "9001"])
    assert (ns.model, ns.tensor_parallel_size, ns.enable_prefix_caching, ns.port, ns.metrics_require_key) == \
        ("/models/llama", 2, False, 9001, True)
    assert ns.lora_modules == ["a=/l/a", "b=/l/b"] and ns.allowed_origins == ["https://chat.example"]
    assert json.loads(ns.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}
    assert _parse(["serve", "/other", f"--config={config}"]).model == "/other", "the command line's model wins"
    bench = tmp_path / "bench.yaml"
    bench.write_text("dtype: bfloat16\n")
    assert _parse(["bench", "latency", "--config", str(bench)]).dtype == "bfloat16"


def test_a_bad_config_file_is_named(tmp_path, capsys):
    for text, why in [("tensor-parallel: 2\n", "tensor-parallel is no option of `shardlm serve`"),
                      ("- 1\n", "give a mapping of flags to values"), ("a: [\n", "cannot read it as YAML")]:
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--config", str(tmp_path / "c.yaml")])
        assert exited.value.code == 2 and why in capsys.readouterr().err
