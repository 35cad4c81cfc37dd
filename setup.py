"""The one compiled part: connectors._pageio, the file connector's page I/O on threads of its own that never
take the GIL, and xxh3 from the vendored xxHash (connectors/_vendor). It is optional: without a C compiler the
install still succeeds and the file connector uses its Python path (slower, same files)."""

import platform

from setuptools import Extension, setup

sources = ["connectors/_pageio.c", "connectors/_vendor/xxhash.c"]
# Symbols of our own, so they never meet those of another module that links xxHash.
macros = [("XXH_NAMESPACE", "hicached_")]
if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
    sources.append("connectors/_vendor/xxh_x86dispatch.c")  # picks AVX-512 / AVX2 / SSE2 at run time
    sources.append("connectors/_pageio_simd.c")  # the store's copy + xxh3 in one pass, for AVX2 CPUs
    macros.append(("HICACHED_XXH_DISPATCH", "1"))

setup(
    ext_modules=[
        Extension(
            "connectors._pageio",
            sources,
            include_dirs=["connectors/_vendor"],
            define_macros=macros,
            # -pthread: the module's Engine runs threads of its own (older glibc keeps them in libpthread).
            extra_compile_args=["-O3", "-std=c11", "-pthread", "-Wall", "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
