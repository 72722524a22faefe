"""cffi (API mode) build script of ``freetoken_sglang._cpu_executor``, the C expert executor.

``setup.py`` names it in ``cffi_modules``, so ``pip install`` (editable or not) compiles the
module (an optional extension: without a compiler the install goes on without it);
``python freetoken_sglang/_cpu_executor_build.py`` (from any directory) builds it in place.
No ``-march``: every SIMD path carries its own target attribute and is chosen at run time, so
one binary runs on any x86-64 CPU.
"""

import glob
import os
import re
import shutil
import tempfile

import cffi

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HEADER = os.path.join(_ROOT, "kernels", "cpu_executor.h")


def _cdef() -> str:
    """The declarations between the FT_CDEF markers of the header (plain C, no macros)."""
    with open(_HEADER) as f:
        text = f.read()
    match = re.search(r"/\* FT_CDEF_BEGIN \*/(.*)/\* FT_CDEF_END \*/", text, re.S)
    if match is None:
        raise RuntimeError(f"{_HEADER} lacks the FT_CDEF_BEGIN/FT_CDEF_END markers")
    return match.group(1)


def make_builder(root: str = "", optional: bool = True) -> cffi.FFI:
    """The FFI builder; source paths are relative to ``root`` (setuptools, which runs in the
    repo root, rejects absolute source paths; ``FFI.compile`` changes directory, so the direct
    build passes the absolute repo root). With ``optional``, a failed compile (no compiler,
    no Python headers) only warns and the package installs without the module; importing
    ``freetoken_sglang.cpu.executor`` then raises an ImportError that says how to build it."""
    builder = cffi.FFI()
    builder.cdef(_cdef())
    builder.set_source(
        "freetoken_sglang._cpu_executor",
        '#include "cpu_executor.h"',
        sources=[os.path.join(root, "kernels", "cpu_executor.c")],
        include_dirs=[os.path.join(root, "kernels")],
        extra_compile_args=["-O3", "-std=gnu11", "-fno-strict-aliasing", "-Wall"],
        libraries=["pthread", "m"],
        optional=optional,
    )
    return builder


ffibuilder = make_builder()

if __name__ == "__main__":
    package = os.path.join(_ROOT, "freetoken_sglang")
    with tempfile.TemporaryDirectory() as tmp:
        built = make_builder(_ROOT, optional=False).compile(tmpdir=tmp, verbose=True)
        for stale in glob.glob(os.path.join(package, "_cpu_executor*.so")):
            os.remove(stale)  # an older build (e.g. pip's .abi3.so) would shadow or be shadowed
        shutil.copy2(built, package)
        print("built", os.path.join(package, os.path.basename(built)))
