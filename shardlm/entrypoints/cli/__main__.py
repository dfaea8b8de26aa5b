"""`python -m shardlm.entrypoints.cli`: the `shardlm` command."""

from shardlm.entrypoints.cli import main

main()
