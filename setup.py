"""The one compiled part: connectors._pageio, the file connector's page I/O with the GIL released once per
job, and xxh3 from the vendored xxHash (connectors/_vendor). It is optional: without a C compiler the
install still succeeds and the file connector uses its Python path (slower, same files)."""

import platform

from setuptools import Extension, setup

sources = ["connectors/_pageio.c", "connectors/_vendor/xxhash.c"]
# Symbols of our own, so they never meet those of another module that links xxHash.
macros = [("XXH_NAMESPACE", "hicached_")]
if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
    sources.append("connectors/_vendor/xxh_x86dispatch.c")  # picks AVX-512 / AVX2 / SSE2 at run time
    macros.append(("HICACHED_XXH_DISPATCH", "1"))

setup(
    ext_modules=[
        Extension(
            "connectors._pageio",
            sources,
            include_dirs=["connectors/_vendor"],
            define_macros=macros,
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
