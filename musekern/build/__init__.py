"""Build: compile planned variants with the CuTe DSL (CPU is enough) and make them present in the store."""
from .compile import BUILD_EXTRA_HINT, BuildError, BuildExtraMissing, Built, build_variant

__all__ = ["BUILD_EXTRA_HINT", "BuildError", "BuildExtraMissing", "Built", "build_variant"]
