"""The builder: compile planned variants with the CuTe DSL (CPU is enough) and make them present in the store.

    compile.py    one variant -> a checked cubin + the builder's part of its manifest (one ABI check a build)
    dsl.py        the CuTe DSL compile call (imports cutlass)
    prepare.py    a whole plan into a cache: parallel workers, remote pulls and pushes, progress
    autobuild.py  the loader's on_miss hook for MUSEKERN_AUTOBUILD (the runtime never imports the builder)
"""
from .compile import BUILD_EXTRA_HINT, BuildError, BuildExtraMissing, Built, CompiledKernel, build_variant

__all__ = ["BUILD_EXTRA_HINT", "BuildError", "BuildExtraMissing", "Built", "CompiledKernel", "build_variant"]
