"""The package's shape: no import cycles among shardlm's modules (function-level imports
counted), config.py and messages.py are leaves, nothing below the entry points imports the
package's face, and distributed/ is the runtime only (no CLI diagnostics in it)."""

import ast
import os
import pathlib
import subprocess
import sys

import shardlm

ROOT = pathlib.Path(shardlm.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """shardlm modules imported anywhere in the file, inside functions too (they run when called);
    not under `if TYPE_CHECKING` (they never run)."""
    tree = ast.parse(path.read_text())
    found = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]

    def visit(node):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base
                                                                                                  else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in modules and m != _module_name(path)}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(path, set(files)) for name, path in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            strongconnect(v)
    return out


def test_no_import_cycles():
    graph = _graph()
    assert "shardlm.core.engine_core" in graph and graph["shardlm.core.engine_core"]   # the parser sees imports
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_leaves_and_layers():
    graph = _graph()
    assert graph["shardlm.config"] == {"shardlm.kv_cache_groups"}
    assert graph["shardlm.kv_cache_groups"] == set()
    assert graph["shardlm.messages"] <= {"shardlm.sampling_params", "shardlm.lora.request", "shardlm.outputs",
                                         "shardlm.pooling.params"}
    assert graph["shardlm.lora.request"] == set()         # leaves: they travel inside messages
    assert graph["shardlm.pooling.params"] == set()
    assert graph["shardlm.outputs"] == set()
    for name, imports in graph.items():             # a lower floor never imports a higher one
        if name.startswith("shardlm.model_loader"):
            assert not any(m.startswith("shardlm.models") for m in imports), name
        if name.startswith("shardlm.layers"):
            assert "shardlm.messages" not in imports, name
    for name, imports in graph.items():
        if name.startswith("shardlm.core"):         # the engine-core process: not the front end
            assert not any(m.startswith(("shardlm.engine", "shardlm.entrypoints")) for m in imports), name
        if name.startswith(("shardlm.layers", "shardlm.worker", "shardlm.attention")):
            assert not any(m.startswith(("shardlm.engine", "shardlm.entrypoints")) for m in imports), name
        if name.startswith("shardlm.distributed"):
            assert not any(m.startswith(("shardlm.entrypoints", "shardlm.engine", "shardlm.executor"))
                           for m in imports), name
        if not name.startswith("shardlm.entrypoints") and name != "shardlm":
            assert "shardlm" not in imports, f"{name} imports the package's face (shardlm/__init__.py)"
    assert not (ROOT / "distributed" / "preflight.py").exists()
    assert not (ROOT / "distributed" / "cluster_check.py").exists()


def test_the_package_and_its_cli_load_without_torch():
    """Importing shardlm, its CLI and processes.py loads no torch (the public names do, `startup`
    first), so that `shardlm serve` can start its fork server before it imports torch itself."""
    code = ("import sys, shardlm, shardlm.entrypoints.cli, shardlm.processes\n"
            "assert 'torch' not in sys.modules, 'torch loaded'\n"
            "from shardlm import LLM, SamplingParams\n"
            "assert 'torch' in sys.modules and sys.modules['shardlm.startup'].THREADS_AT_IMPORT > 0\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_serve_starts_the_fork_server_before_it_imports_torch():
    code = ("import sys, multiprocessing.forkserver as forkserver\n"
            "forkserver.ensure_running = lambda: print('torch' in sys.modules)\n"
            "from shardlm.entrypoints.cli import main\n"
            "main(['serve', '/no/such/model'])\n")
    env = {k: v for k, v in os.environ.items() if k != "SHARDLM_WORKER_MULTIPROC_METHOD"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 2, run.stderr[-2000:]           # the model does not exist: a plain error
    assert run.stdout.split()[0] == "False", "the fork server started after torch was imported"

