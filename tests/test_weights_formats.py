"""musekern/weights/formats.py: which checkpoint formats a config.json's quantization_config announces."""
import pytest

from musekern.weights.formats import (
    BF16,
    OVERRIDE_CHOICES,
    UnsupportedWeightFormat,
    WeightFormat,
    parse_override,
    parse_quantization_config,
)

SRC = "cfg.json"
CT_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None, "actorder": None,
          "observer": "minmax", "observer_kwargs": {}}


def ct(weights: dict, *, targets=("Linear",), ignore=("lm_head",), fmt="float-quantized", acts=None, groups=None):
    """A compressed-tensors quantization_config as llm-compressor saves it (one group unless `groups`)."""
    group = {"targets": list(targets), "weights": {**CT_FP8, **weights}, "output_activations": None,
             "input_activations": acts}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "global_compression_ratio": None, "kv_cache_scheme": None, "ignore": list(ignore),
            "config_groups": groups if groups is not None else {"group_0": group}}


def layers(n, projs=("q_proj", "k_proj", "v_proj", "o_proj"), prefix="model.layers."):
    return [f"{prefix}{i}.self_attn.{p}" for i in range(n) for p in projs]


DS_V3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
QWEN3_MOE_GATES = [f"model.layers.{i}.mlp.gate" for i in range(48)] + ["lm_head"]


# One published-looking config of each format musekern reads (research/fp8.md section 1, "Formats to support
# first"): the block-128 family (DeepSeek-V3 fp32 scales, V3.1 ue8m0, Qwen3-FP8 whose bf16 weight_scale_inv looks
# the same in config.json, MiniMax-M2's torch-dtype `fmt` and its router `gate` entries), the older per-tensor fp8,
# compressed-tensors' three FP8 presets (and the older "128x128" block spelling), fbgemm_fp8. num_layers: the
# config's num_hidden_layers where the entries are per-layer.
@pytest.mark.parametrize("qc,want,num_layers", [
    (None, ("bf16", "none", None, False), None),
    (DS_V3, ("fp8_e4m3", "block", (128, 128), False), None),
    ({**DS_V3, "scale_fmt": "ue8m0"}, ("fp8_e4m3", "block", (128, 128), True), None),
    ({**DS_V3, "modules_to_not_convert": QWEN3_MOE_GATES}, ("fp8_e4m3", "block", (128, 128), False), 48),
    ({**DS_V3, "fmt": "float8_e4m3fn", "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
     ("fp8_e4m3", "block", (128, 128), False), None),
    ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
     ("fp8_e4m3", "tensor", None, False), None),
    (ct({"strategy": "block", "block_structure": [128, 128]},
        acts={**CT_FP8, "strategy": "group", "group_size": 128, "dynamic": True}),
     ("fp8_e4m3", "block", (128, 128), False), None),
    (ct({"strategy": "block", "block_structure": "128x128"}), ("fp8_e4m3", "block", (128, 128), False), None),
    (ct({"strategy": "channel"}, acts={**CT_FP8, "strategy": "token", "dynamic": True}),
     ("fp8_e4m3", "channel", None, False), None),
    (ct({"strategy": "tensor"}, acts={**CT_FP8, "strategy": "tensor"}), ("fp8_e4m3", "tensor", None, False), None),
    (ct({"strategy": None, "group_size": -1}), ("fp8_e4m3", "channel", None, False), None),  # inferred strategy
    (ct({"strategy": "channel"}, targets=["re:.*self_attn.*", "re:.*mlp.*"], ignore=["lm_head", "re:.*mlp.gate$"]),
     ("fp8_e4m3", "channel", None, False), None),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
     ("fp8_e4m3", "channel", None, False), None),
    # targets that name one model's modules (not the multimodal wrapper's): read under that naming
    (ct({"strategy": "channel"}, targets=[r"re:model\.layers\.\d+\.self_attn\..*"]),
     ("fp8_e4m3", "channel", None, False), 32),
])
def test_published_formats(qc, want, num_layers):
    f = parse_quantization_config(qc, SRC, num_layers=num_layers)
    assert (f.dtype, f.granularity, f.block, f.ue8m0) == want
    assert not f.note and parse_override(f.name) == f  # the override vocabulary names every format read


def test_sources_and_scale_dtypes():
    assert parse_quantization_config(DS_V3, SRC).source == "fp8 (block 128x128)"
    assert parse_quantization_config({**DS_V3, "scale_fmt": "ue8m0"}, SRC).source == "fp8 (block 128x128, ue8m0)"
    f = parse_quantization_config(ct({"strategy": "channel"}), SRC)
    assert f.source == "compressed-tensors FP8_DYNAMIC" and f.scale_dtype == "bfloat16"  # the model's dtype
    assert parse_quantization_config(ct({"strategy": "block", "block_structure": [128, 128]}), SRC).source == \
        "compressed-tensors FP8_BLOCK"
    assert parse_quantization_config(ct({"strategy": "tensor"}), SRC).source == "compressed-tensors FP8"
    assert parse_quantization_config(DS_V3, SRC).scale_dtype == "float32"


# Checkpoints whose attention q/k/v stay bf16 under each way configs say so: a substring-style name
# (transformers' modules_to_not_convert), vLLM's alias ignored_layers, a compressed-tensors regex and a group
# whose targets miss the attention, a ModelOpt-style glob, and Llama-3.1-405B-FP8's per-layer list of every
# layer's attention (fbgemm_fp8), which needs num_hidden_layers to be read as "every layer".
@pytest.mark.parametrize("qc,num_layers", [
    ({**DS_V3, "modules_to_not_convert": ["lm_head", "self_attn"]}, None),
    ({**DS_V3, "ignored_layers": ["q_proj", "k_proj", "v_proj"]}, None),
    (ct({"strategy": "channel"}, ignore=["lm_head", "re:.*self_attn.*"]), None),
    (ct({"strategy": "channel"}, targets=["re:.*mlp.*"]), None),
    (ct({"strategy": "channel"}, ignore=["re:model.language_model.layers.*"]), 48),  # a wrapper's naming
    ({"quant_method": "fp8", "ignored_layers": ["model.language_model.layers.*.self_attn*"]}, None),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
      "modules_to_not_convert": layers(126) + ["model.layers.0.mlp", "model.layers.125.mlp", "lm_head"]}, 126),
])
def test_attention_kept_in_bf16_is_bf16(qc, num_layers):
    f = parse_quantization_config(qc, SRC, num_layers=num_layers)
    assert f == BF16 and f.note and not f.fp8


# What musekern refuses, each with the key that says so and what it would take instead: other quant methods
# (AWQ/GPTQ int4, bitsandbytes, MXFP4), other fp8 encodings and block sizes, compressed-tensors int/fp4 formats,
# group and asymmetric strategies, and fronts that would mix bf16 and fp8 (a layer's attention, one projection,
# two groups quantizing q and k/v differently).
@pytest.mark.parametrize("qc,key,reason,num_layers", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
     "quantization_config.quant_method", "'awq' is not read", None),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "quantization_config.quant_method",
     "'gptq' is not read", None),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization_config.quant_method", "not read", None),
    ({"quant_method": "mxfp4"}, "quantization_config.quant_method", "'mxfp4' is not read", None),
    ({"activation_scheme": "dynamic"}, "quantization_config.quant_method", "missing is not read", None),
    ([1], "quantization_config", "JSON object", None),
    ({**DS_V3, "fmt": "e5m2"}, "quantization_config.fmt", "only e4m3", None),
    ({**DS_V3, "weight_block_size": [64, 64]}, "quantization_config.weight_block_size", "only [128, 128]", None),
    ({**DS_V3, "weight_block_size": 128}, "quantization_config.weight_block_size", "only [128, 128]", None),
    ({**DS_V3, "scale_fmt": "e8m0x"}, "quantization_config.scale_fmt", "\"float\" or \"ue8m0\"", None),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "quantization_config.scale_fmt", "weight_block_size", None),
    ({**DS_V3, "modules_to_not_convert": "lm_head"}, "quantization_config.modules_to_not_convert",
     "list of module names", None),
    ({**DS_V3, "modules_to_not_convert": ["model.layers.0.self_attn"]}, "quantization_config.modules_to_not_convert",
     "mixes bf16 and fp8 layers", 61),
    ({**DS_V3, "modules_to_not_convert": ["q_proj"]}, "quantization_config.modules_to_not_convert",
     "'q_proj'", None),
    ({"quant_method": "fbgemm_fp8", "modules_to_not_convert": layers(61)}, "quantization_config.modules_to_not_convert",
     "mixes bf16 and fp8", None),  # every layer of 61, but the config did not say there are 61
    (ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, fmt="pack-quantized"),
     "quantization_config.format", "'pack-quantized' is not read", None),
    (ct({"num_bits": 8, "type": "int", "strategy": "channel"}, fmt="int-quantized"), "quantization_config.format",
     "'int-quantized'", None),
    (ct({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, fmt="nvfp4-pack-quantized"),
     "quantization_config.format", "nvfp4", None),
    (ct({"num_bits": 8, "type": "int", "strategy": "channel"}), "quantization_config.config_groups.group_0.weights",
     "num_bits 8 type 'int'", None),
    (ct({"strategy": "group", "group_size": 128}), "quantization_config.config_groups.group_0.weights.strategy",
     "'group' is not read", None),
    (ct({"strategy": "block", "block_structure": [64, 128]}),
     "quantization_config.config_groups.group_0.weights.block_structure", "only [128, 128]", None),
    (ct({"strategy": "channel", "symmetric": False}), "quantization_config.config_groups.group_0.weights.symmetric",
     "asymmetric", None),
    (ct({"strategy": "tensor", "dynamic": True}), "quantization_config.config_groups.group_0.weights.dynamic",
     "run time", None),
    (ct({}, groups={}), "quantization_config.config_groups", "non-empty", None),
    (ct({}, groups={"group_0": {"targets": "Linear", "weights": CT_FP8}}),
     "quantization_config.config_groups.group_0.targets", "list of names", None),
    (ct({}, groups={"group_0": {"targets": ["Linear"]}}), "quantization_config.config_groups.group_0.weights",
     "no float8 weights", None),
    (ct({}, groups={"group_0": {"targets": ["re:.*q_proj$"], "weights": {**CT_FP8, "strategy": "channel"}},
                    "group_1": {"targets": ["re:.*[kv]_proj$"], "weights": {**CT_FP8, "strategy": "block",
                                                                            "block_structure": [128, 128]}}}),
     "quantization_config.config_groups.group_1", "one format", None),
    (ct({"strategy": "channel"}, targets=["re:.*q_proj$"]), "quantization_config.ignore",
     "mixes bf16 and fp8 layers", None),
    (ct({"strategy": "channel"}, ignore=["model.layers.3.self_attn.k_proj"]), "quantization_config.ignore",
     "mixes bf16 and fp8 layers", 40),
])
def test_refused_with_key_and_reason(qc, key, reason, num_layers):
    with pytest.raises(UnsupportedWeightFormat) as ei:
        parse_quantization_config(qc, SRC, num_layers=num_layers)
    e = ei.value
    assert isinstance(e, ValueError) and e.source == SRC and e.key == key and reason in e.reason, str(e)
    assert str(e).startswith(f"{SRC}: {key}: ") and "\n" not in str(e)
    if "not read" in reason or "only" in reason:
        assert "supported: bf16" in str(e)  # says what IS supported


@pytest.mark.parametrize("value", OVERRIDE_CHOICES)
def test_override_vocabulary(value):
    f = parse_override(value)
    if value == "auto":
        assert f is None
    else:
        assert f.name == value and parse_override(value.upper()) == f


@pytest.mark.parametrize("value", ["fp8", "fp8-e5m2", "int4", "", "fp8-tensor-ue8m0", "fp8-channel-ue8m0"])
def test_override_refused_lists_choices(value):
    with pytest.raises(ValueError, match="choose one of auto, bf16, fp8-block"):
        parse_override(value)


def test_weight_format_is_consistent():
    assert BF16 == WeightFormat() and not BF16.fp8 and BF16.name == "bf16"
    assert WeightFormat(note="why") == BF16  # a note describes, it does not distinguish
    for bad in (dict(dtype="fp8_e4m3"), dict(granularity="block"), dict(dtype="fp8_e4m3", granularity="block"),
                dict(dtype="fp8_e4m3", granularity="channel", ue8m0=True), dict(scale_dtype="float64"),
                dict(dtype="fp8_e5m2", granularity="tensor")):
        with pytest.raises(ValueError, match="inconsistent WeightFormat"):
            WeightFormat(**bad)
