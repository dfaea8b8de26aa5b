"""The `shardlm` command itself (each subcommand has tests of its own)."""

import pytest

import shardlm
from shardlm.entrypoints.cli import main


def test_shardlm_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"shardlm {shardlm.__version__}\n"
