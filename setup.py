"""Builds the CPU kernel library at install time, one per ISA variant (shardlm/kernels/build.py);
everything else about the package is in pyproject.toml. A machine without a working C compiler
still installs: the kernels then compile at run time, or the layers run on torch ops."""

import importlib.util
import os
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _kernel_build_module():
    # by path: importing the shardlm package would import torch, absent from an isolated build
    spec = importlib.util.spec_from_file_location("shardlm_kernel_build",
                                                  os.path.join(HERE, "shardlm", "kernels", "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _libraries(directory: str) -> list[str]:
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return [n for n in names if n.startswith("shardlm_kernels-") and n.endswith(".so")]


def _remove_libraries(directory: str) -> None:
    for name in _libraries(directory):
        os.unlink(os.path.join(directory, name))


class KernelLibraries(Extension):
    """Not a Python extension: the kernel libraries, loaded with ctypes."""

    def __init__(self):
        super().__init__("shardlm.kernels.prebuilt.shardlm_kernels", sources=[])


class BuildKernels(build_ext):
    def build_extension(self, ext):
        if not isinstance(ext, KernelLibraries):
            return super().build_extension(ext)
        build = _kernel_build_module()
        out_dir = self.kernel_dir = os.path.dirname(self.get_ext_fullpath(ext.name))
        _remove_libraries(out_dir)        # earlier sources' libraries
        cc = build.find_compiler()
        if cc is None:
            print("shardlm: no C compiler; the CPU kernels will compile at run time where one is found",
                  file=sys.stderr)
            return
        for isa, result in build.build_prebuilt(cc, out_dir).items():
            print(f"shardlm: kernel library {isa}: {result}", file=sys.stderr)

    def copy_extensions_to_source(self):
        """Editable installs: the libraries go beside the sources (earlier ones removed)."""
        build_dir = getattr(self, "kernel_dir", None)
        if build_dir is None:
            return
        source_dir = os.path.join(HERE, "shardlm", "kernels", "prebuilt")
        _remove_libraries(source_dir)
        for name in _libraries(build_dir):
            os.makedirs(source_dir, exist_ok=True)
            shutil.copy(os.path.join(build_dir, name), source_dir)

    def get_outputs(self):
        return [p for p in super().get_outputs() if "shardlm_kernels" not in os.path.basename(p)]


setup(ext_modules=[KernelLibraries()], cmdclass={"build_ext": BuildKernels})
