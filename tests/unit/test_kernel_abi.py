"""Every entry point of shardlm_kernels.h has the ctypes signature kernels/__init__.py gives it;
the one-call decode step's C structs (shardlm_kernels.h) and their ctypes mirrors
(kernels/decode_abi.py) agree field by field: the same names in the same order, and for each the
offset, size and kind (int32, int64, float, pointer) that the C compiler gives it, and the same
struct sizes. A field swapped, added or retyped on one side fails here, not as a segfault."""

import os
import re
import subprocess

import pytest

from shardlm.kernels import build
from shardlm.kernels import decode_abi as abi

HEADER = os.path.join(os.path.dirname(build.__file__), "shardlm_kernels.h")


def _c_struct_fields(name: str) -> list[str]:
    """The field names of `typedef struct { ... } name;` in the header, in order."""
    body = re.search(r"typedef struct \{([^}]*)\}\s*" + name + r";", open(HEADER).read()).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    return [re.findall(r"\w+", declarator)[-1] for declaration in body.split(";") if declaration.strip()
            for declarator in declaration.split(",")]


def _kind(ctype) -> str:
    import ctypes
    return {ctypes.c_int32: "int32", ctypes.c_int64: "int64", ctypes.c_float: "float"}.get(ctype, "pointer")


def _c_layouts(tmp_path, structs) -> dict[str, list]:
    """{struct: [size, (field, offset, size, kind), ...]} as the C compiler lays them out."""
    cc = build.find_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    lines = []
    for s in structs:
        lines.append(f'printf("{s.__name__} %zu\\n", sizeof({s.__name__}));')
        for field, _ in s._fields_:
            member = f"((({s.__name__} *)0)->{field})"
            lines.append(f'printf("{s.__name__} {field} %zu %zu %s\\n", offsetof({s.__name__}, {field}), '
                         f"sizeof({member}), KIND({member}));")
    source = tmp_path / "layout.c"
    source.write_text("#include <stddef.h>\n#include <stdio.h>\n#include \"shardlm_kernels.h\"\n"
                      '#define KIND(x) _Generic((x), int32_t: "int32", int64_t: "int64", float: "float", '
                      'default: "pointer")\n'
                      "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", os.path.dirname(HEADER), str(source), "-o", str(exe)], check=True)
    out: dict[str, list] = {}
    for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            out[parts[0]] = [int(parts[1])]
        else:
            out[parts[0]].append((parts[1], int(parts[2]), int(parts[3]), parts[4]))
    return out


def _py_layout(struct) -> list:
    import ctypes
    return [ctypes.sizeof(struct)] + [(name, getattr(struct, name).offset, getattr(struct, name).size, _kind(ctype))
                                      for name, ctype in struct._fields_]


def test_every_decode_struct_has_the_c_fields_in_order():
    for struct in abi.STRUCTS:
        assert [name for name, _ in struct._fields_] == _c_struct_fields(struct.__name__), struct.__name__


def test_every_decode_struct_is_laid_out_as_c_lays_it_out(tmp_path):
    c = _c_layouts(tmp_path, abi.STRUCTS)
    for struct in abi.STRUCTS:
        assert _py_layout(struct) == c[struct.__name__], struct.__name__


def test_the_ctypes_signatures_are_the_c_declarations():
    """kernels/__init__.py's SIGNATURES and shardlm_kernels.h (against which the compiler checks
    every definition) declare the same entry points with the same argument and result types; a
    pointer to one of the decode structs is a pointer to its mirror."""
    import ctypes

    from shardlm import kernels
    structs = {s.__name__: s for s in abi.STRUCTS}
    scalars = {"void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
               "float": ctypes.c_float}

    def ctype(param: str):
        words = param.replace("*", " * ").split()
        if "(*" in param.replace(" ", ""):
            return "callback"
        if "*" in words:
            struct = next((w for w in words if w in structs), None)
            return ctypes.POINTER(structs[struct]) if struct else ctypes.c_void_p
        return scalars[words[-2]]

    declared = {}
    for result, name, params in re.findall(r"KERNEL_API\s+(\w+)\s+(\w+)\(([^;]*)\);", open(HEADER).read()):
        params = [p.strip() for p in params.replace("\n", " ").split(",")]
        declared[name] = ([ctype(p) for p in params if p not in ("void", "")], scalars[result])
    assert len(declared) >= 20
    ours = {name: ([a if not hasattr(a, "_flags_") else "callback" for a in args], result)
            for name, (args, result) in kernels.SIGNATURES.items()}
    assert ours == declared
