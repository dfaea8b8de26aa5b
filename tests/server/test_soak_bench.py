"""`shardlm bench serve --duration`: the soak's report over time, against a real server whose KV
cache is too small for its clients (so it preempts): rows per interval with throughput, latency,
each server process's RSS and the preemptions; no request fails; the plot is written."""

import json

import pytest

from shardlm.entrypoints.cli import main
from tests.helpers import start_server, stop_server


@pytest.mark.slow
def test_a_short_soak_reports_each_interval_and_forces_preemption(tiny_model_dir, tmp_path, capsys):
    log = open(tmp_path / "server.log", "w")        # a line per preemption: more than a pipe holds
    proc, url = start_server(tiny_model_dir("llama-gqa"), "--kv-cache-memory", "256KiB", stderr=log)
    try:
        png = tmp_path / "soak.png"
        capsys.readouterr()
        main(["bench", "serve", "--base-url", url, "--duration", "5s", "--ramp", "1.25s", "--interval", "1.25s",
              "--concurrency", "16", "--output-len", "48", "--server-pid", str(proc.pid), "--plot", str(png),
              "--json"])       # in this process: a new interpreter's imports would add ~3 s
        r = json.loads(capsys.readouterr().out)
    finally:
        stop_server(proc)
        log.close()
    assert r["failed"] == 0 and r["completed"] > 16, r["errors"]
    assert r["preemptions"] > 0, "a KV cache of 256 KiB holds fewer tokens than 16 clients need"
    rows = r["windows"]
    assert len(rows) >= 4 and all(w["completed"] > 0 for w in rows[1:])
    assert all(any(name.startswith("shardlm-core") for name in w["rss_mib"]) for w in rows)
    assert rows[-1]["clients"] == 16 and all(w["itl_ms_p99"] is not None for w in rows[1:])
    assert png.stat().st_size > 10_000
