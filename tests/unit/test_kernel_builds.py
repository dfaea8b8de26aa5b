"""Kernels that ship and fail safe: a built wheel carries the libraries built at install time
(one per ISA variant) and every file they compile from, and they load from an install with no
compiler; each way a build can fail (no compiler, a compile error, an
unwritable cache, a library that does not load) is logged and the layer falls back to torch ops,
unless SHARDLM_REQUIRE_KERNELS makes it an error; SHARDLM_CPU_ISA caps the variant."""

import logging
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from shardlm import envs, kernels
from shardlm.kernels import build

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path, caplog):
    """A kernel cache of the test's own, no libraries built at install time (the test's own
    directory for them), looked up anew, and shardlm's log in caplog; the engine's kernels
    restored after."""
    monkeypatch.setattr(envs, "SHARDLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "PREBUILT_DIR", str(tmp_path / "prebuilt"))
    monkeypatch.setattr(envs, "SHARDLM_REQUIRE_KERNELS", False)      # CI sets it
    kernels.use_isa(envs.SHARDLM_CPU_ISA)
    shardlm_log = logging.getLogger("shardlm")         # it does not propagate to the root logger
    shardlm_log.addHandler(caplog.handler)
    yield tmp_path
    shardlm_log.removeHandler(caplog.handler)
    monkeypatch.undo()
    kernels.use_isa(envs.SHARDLM_CPU_ISA)


def _script(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("failure", ["missing compiler", "compile error", "library that does not load"])
def test_a_kernel_that_cannot_be_built_falls_back_with_a_warning(failure, fresh_kernels, monkeypatch, caplog):
    tmp = fresh_kernels
    cc = {"missing compiler": str(tmp / "no-such-cc"),
          "compile error": _script(tmp / "cc-error", "echo 'kernel.c:1: error: broken' >&2; exit 1\n"),
          # "compiles" by writing a file that is not a shared library where the output goes
          "library that does not load": _script(tmp / "cc-junk", 'while [ $# -gt 1 ]; do [ "$1" = -o ] && '
                                                'echo junk > "$2"; shift; done; exit 0\n')}[failure]
    monkeypatch.setenv("CC", cc)
    assert kernels.library() is None and kernels.fused_ops() is None and kernels.blocked_matmul() is None
    assert "CPU kernels are unavailable" in caplog.text and "torch ops" in caplog.text
    if failure == "compile error":
        assert "error: broken" in caplog.text
    monkeypatch.setattr(envs, "SHARDLM_REQUIRE_KERNELS", True)
    kernels.use_isa(envs.SHARDLM_CPU_ISA)
    with pytest.raises(kernels.KernelBuildError, match="SHARDLM_REQUIRE_KERNELS"):
        kernels.library()


def test_a_library_built_at_install_time_needs_no_compiler(fresh_kernels, monkeypatch, caplog):
    """The installed library of the variant in use loads without a compiler; one that does not
    load is reported and the kernels compile at run time instead."""
    kernels.use_isa("portable")
    installed = os.path.join(build.PREBUILT_DIR, build.prebuilt_name("portable"))
    os.makedirs(build.PREBUILT_DIR)
    with open(installed, "w") as f:
        f.write("not a library")
    assert kernels.fused_ops() is not None
    assert "does not load" in caplog.text and kernels.describe()["library"].startswith("built at run time")
    caplog.clear()
    build.compile_library(os.environ.get("CC") or "cc", [*build.FLAGS, *build.variant_flags("portable")], installed)
    monkeypatch.setenv("CC", str(fresh_kernels / "no-such-cc"))
    kernels.use_isa("portable")
    assert kernels.fused_ops() is not None
    assert kernels.describe()["library"] == "built at install time for portable"
    assert "unavailable" not in caplog.text


def test_an_install_time_build_is_copied_from_the_cache_the_second_time(tmp_path, monkeypatch):
    """The same sources, compiler and flags again (a reinstall, a wheel built beside an editable
    install): the library is copied from the cache, with its mode; other flags compile anew."""
    calls = tmp_path / "calls"
    cc = tmp_path / "cc"            # the real compiler, each call written down
    cc.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {build.find_compiler()} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("SHARDLM_CACHE_DIR", str(tmp_path / "cache"))
    flags = [*build.FLAGS, *build.variant_flags("portable")]

    def compiles() -> int:
        return calls.read_text().count(" -c ")
    first = build.build_through_cache(str(cc), flags, str(tmp_path / "a" / "lib.so"))
    assert compiles() == len(build.sources())
    second = build.build_through_cache(str(cc), flags, str(tmp_path / "b" / "lib.so"))
    assert compiles() == len(build.sources()), "copied, not compiled"
    with open(first, "rb") as a, open(second, "rb") as b:
        assert a.read() == b.read()
    assert os.stat(second).st_mode & 0o777 == os.stat(first).st_mode & 0o777 and os.stat(second).st_mode & 0o044
    build.build_through_cache(str(cc), [*flags, "-DSHARDLM_ANOTHER_FLAG"], str(tmp_path / "c" / "lib.so"))
    assert compiles() == 2 * len(build.sources())


@pytest.mark.slow
def test_an_unwritable_cache_builds_in_a_temporary_directory(fresh_kernels, monkeypatch, caplog):
    blocker = fresh_kernels / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(envs, "SHARDLM_CACHE_DIR", str(blocker / "cache"))     # below a file: cannot be made
    kernels.use_isa("portable")               # the quickest variant to compile (the ISA plays no part)
    assert kernels.fused_ops() is not None
    assert "Cannot write the kernel cache" in caplog.text


@pytest.mark.slow
def test_the_isa_cap_selects_the_variant(fresh_kernels):
    assert kernels.use_isa("portable") == "portable" and kernels.blocked_matmul() is None
    assert kernels.fused_ops() is not None                 # plain C: every CPU
    best = kernels.best_isa()
    assert kernels.use_isa("native") == "native" and kernels.fused_ops() is not None
    assert (kernels.blocked_matmul() is not None) == best.startswith(("avx2", "avx512", "amx"))
    with pytest.raises(ValueError, match="use one of portable, avx2"):
        kernels.use_isa("sse9")
    built = os.listdir(os.path.join(envs.SHARDLM_CACHE_DIR, "kernels"))
    assert any(name.startswith("shardlm_kernels-portable-") for name in built)
    assert any(name.startswith("shardlm_kernels-native-") for name in built)


@pytest.mark.slow
def test_a_built_wheel_carries_the_kernels_and_they_load_from_the_install(tmp_path):
    """pip wheel, installed into a fresh environment (beside this one's torch): it holds a library
    per ISA variant, built at install time (copied from the install-time cache where this
    checkout's editable install built the same ones), and the kernels load from it with no
    compiler (CC names none) and SHARDLM_REQUIRE_KERNELS set; under the portable cap as well."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), ROOT], check=True, capture_output=True)
    [wheel] = list(wheels.glob("shardlm-*.whl"))
    import zipfile
    names = zipfile.ZipFile(wheel).namelist()
    for isa in build.prebuilt_variants():
        assert f"shardlm/kernels/prebuilt/{build.prebuilt_name(isa)}" in names
    assert "shardlm/kernels/cpu_common.h" in names         # the run-time fallback's sources too
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # torch and the rest from the running environment (system_site_packages would give the base
    # interpreter's, which inside a virtual environment has none of them), after the new site
    # directory, so shardlm comes from the wheel; a path in a .pth file runs none of its .pth files,
    # so the running environment's editable shardlm stays out
    paths = sysconfig.get_paths()
    (Path(site) / "running-environment.pth").write_text(f"{paths['purelib']}\n{paths['platlib']}\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, str(wheel)],
                   check=True, capture_output=True)
    code = ("from shardlm import kernels; import os; "
            "libs = [kernels.fused_ops(), kernels.skinny_matmul(), kernels.paged_decode_attention(), "
            "kernels.llama_decode_layers()]; "
            "print(os.path.dirname(kernels.__file__)); print(all(lib is not None for lib in libs)); "
            "print(kernels.describe()['library'].replace(' ', '_'))")
    for cap in ("native", "portable"):
        run = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                             env={**os.environ, "SHARDLM_REQUIRE_KERNELS": "1", "CC": str(tmp_path / "no-such-cc"),
                                  "SHARDLM_CPU_ISA": cap, "SHARDLM_CACHE_DIR": str(tmp_path / "cache"),
                                  "PYTHONPATH": ""})
        assert run.returncode == 0, run.stderr[-3000:]
        where, loaded, library = run.stdout.split()
        assert where.startswith(site) and loaded == "True"
        assert library.startswith("built_at_install_time_for_"), library


def test_the_cache_key_reads_arm_features_as_well_as_x86_flags():
    """A library built with -march=native is cached under this CPU's flags: ARM's /proc/cpuinfo
    names them `Features`, so two ARM CPUs with different features must not share one."""
    from shardlm.utils import flags_in_cpuinfo
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma\n"
    neoverse = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve sve2 bf16\nCPU implementer\t: 0x41\n"
    graviton2 = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd atomics\nCPU implementer\t: 0x41\n"
    assert flags_in_cpuinfo(x86) == {"fpu", "sse2", "avx2", "fma"}
    assert flags_in_cpuinfo(neoverse) == {"fp", "asimd", "sve", "sve2", "bf16"}
    assert flags_in_cpuinfo(neoverse) != flags_in_cpuinfo(graviton2)
