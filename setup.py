"""The one compiled part: hicached.common._pageio, the client's and the copy executor's page copies with
the GIL released, the file connector's page I/O on threads of its own that never take the GIL, and xxh3
from the vendored xxHash (hicached/common/_vendor). It is optional: without a C compiler the install
still succeeds and each of them uses its Python path (slower, same bytes and files)."""

import platform

from setuptools import Extension, setup

HERE = "hicached/common"
sources = [f"{HERE}/_pageio.c", f"{HERE}/_vendor/xxhash.c"]
# Symbols of our own, so they never meet those of another module that links xxHash.
macros = [("XXH_NAMESPACE", "hicached_")]
if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
    sources.append(f"{HERE}/_vendor/xxh_x86dispatch.c")  # picks AVX-512 / AVX2 / SSE2 at run time
    sources.append(f"{HERE}/_pageio_simd.c")  # the store's copy + xxh3 in one pass, for AVX2 CPUs
    macros.append(("HICACHED_XXH_DISPATCH", "1"))

setup(
    ext_modules=[
        Extension(
            "hicached.common._pageio",
            sources,
            include_dirs=[f"{HERE}/_vendor"],
            define_macros=macros,
            # -pthread: the module's Engine runs threads of its own (older glibc keeps them in libpthread).
            extra_compile_args=["-O3", "-std=c11", "-pthread", "-Wall", "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
