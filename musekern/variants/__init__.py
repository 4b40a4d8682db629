"""The variant planner: pure functions, no cutlass or GPU import."""
from .plan import PlanEntry, plan_model, shard_plan, variant_from_label, variant_types
from .qk_norm import QkNormVariant, qk_norm_variant, qk_norm_variants, supports_qk_norm
from .qkv_epilogue import QkvEpilogueVariant, epilogue_variant, qkv_epilogue_variants
from .qkv_front import FRONT_MAX_TOKENS, QkvFrontVariant, supports_shape
from .qkv_front_rules import (
    fixed_rows,
    front_serves,
    k_split,
    qkv_front_variants,
    ring_stages,
    served_tokens,
    token_tiles,
    variant,
)

__all__ = ["PlanEntry", "plan_model", "shard_plan", "variant_from_label", "variant_types", "QkNormVariant",
           "qk_norm_variant", "qk_norm_variants", "supports_qk_norm", "FRONT_MAX_TOKENS", "QkvFrontVariant",
           "fixed_rows", "front_serves", "k_split", "qkv_front_variants", "ring_stages", "served_tokens",
           "supports_shape", "token_tiles", "variant", "QkvEpilogueVariant", "epilogue_variant",
           "qkv_epilogue_variants"]
