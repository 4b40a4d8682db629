import json
from pathlib import Path

import pytest

from musekern.config import ConfigError, load_config, parse_config, with_tensor_parallel
from musekern.plan import plan_model
from musekern.targets import get_target

DATA = Path(__file__).parent / "data"

BASE = {"hidden_size": 8192, "num_attention_heads": 128, "num_key_value_heads": 8, "head_dim": 64,
        "attn_output_gate": True, "musekern": {"tensor_parallel_sizes": [1, 2, 4, 8], "targets": ["h200"]}}


def write(tmp_path, data, name="cfg.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_bundled_default_is_muse_spark():
    m = load_config()
    assert (m.num_attention_heads, m.num_key_value_heads, m.head_dim, m.hidden_size) == (128, 8, 64, 8192)
    assert m.attn_output_gate and m.tensor_parallel_sizes == (1, 2, 4, 8) and m.targets == ("h200",)


# The per-rank shapes DESIGN.md fixes: N = (nq + nkv + nkv + nq) * 64, kv heads replicate past tp = 8.
@pytest.mark.parametrize("tp,nq,nkv,n", [(1, 128, 8, 17408), (2, 64, 4, 8704), (4, 32, 2, 4352), (8, 16, 1, 2176),
                                         (16, 8, 1, 1152)])
def test_shard_shapes(tp, nq, nkv, n):
    m = parse_config({**BASE, "musekern": {"tensor_parallel_sizes": [tp]}})
    s = m.shard(tp)
    assert (s.num_q_heads, s.num_kv_heads, s.n) == (nq, nkv, n)


def test_unknown_keys_ignored(tmp_path):
    m = load_config(write(tmp_path, {**BASE, "vocab_size": 1, "rope_scaling": None}))
    assert m.hidden_size == 8192


# Each bad input names the file, the key and the reason.
@pytest.mark.parametrize("patch,key,reason", [
    ({"num_attention_heads": None}, "num_attention_heads", "integer"),
    ({"num_key_value_heads": 7}, "num_key_value_heads", "not divisible"),
    ({"head_dim": 128}, "head_dim", "must be 64"),
    ({"hidden_size": -1}, "hidden_size", ">= 1"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps", "finite number"),
    ({"attn_output_gate": "yes"}, "attn_output_gate", "true or false"),
    ({"attn_output_gate": False}, "attn_output_gate", "q | k | v | gate"),
    ({"hidden_size": 4096}, "hidden_size", "must be 8192"),
    ({"torch_dtype": "float8"}, "torch_dtype", "unsupported dtype"),
    ({"dtype": "int4"}, "dtype", "unsupported dtype"),
    ({"head_dim": "64"}, "head_dim", "integer"),
    ({"rope_theta": None}, "rope_theta", "finite number"),
    ({"text_config": [1]}, "text_config", "JSON object"),
    ({"musekern": {"targets": ["a100x"]}}, "musekern.targets", "unknown target"),
    ({"musekern": {"targets": ["a100"]}}, "musekern.targets", "supported targets: b200, h100, h100-pcie, h20, h200"),
    ({"musekern": {"tensor_parallel_sizes": [3]}}, "musekern.tensor_parallel_sizes", "does not divide"),
    ({"musekern": {"tensor_parallel_sizes": []}}, "musekern.tensor_parallel_sizes", "non-empty"),
    ({"musekern": {"max_decode_tokens": 0}}, "musekern.max_decode_tokens", ">= 1"),
    ({"musekern": []}, "musekern", "JSON object"),
])
def test_validation_errors_name_file_key_reason(tmp_path, patch, key, reason):
    p = write(tmp_path, {**BASE, **patch})
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    e = ei.value
    assert e.source == str(p) and e.key == key and reason in e.reason
    assert str(p) in str(e) and key in str(e)


def test_missing_key(tmp_path):
    d = dict(BASE)
    del d["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size: missing required key"):
        load_config(write(tmp_path, d))


# Published config.json files (tests/data): a Qwen3-style one (head_dim null, torch_dtype float32, rope_theta an
# integer) and a multimodal wrapper (text_config, newer "dtype", rope_parameters, a vision_config whose head_dim
# 72 must not be read). Both are Muse Spark's shapes, so with --tp 1,2,4,8 they plan what the bundled config plans.
@pytest.mark.parametrize("name,ckpt", [("qwen3_style.json", "float32"), ("multimodal_wrapper.json", "bfloat16")])
def test_published_configs_read_as_published(name, ckpt):
    m = load_config(DATA / name)
    assert (m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim) == (8192, 128, 8, 64)
    assert m.dtype == "bfloat16" and m.checkpoint_dtype == ckpt and m.rope_theta == 1e6
    # no musekern block: TP 1 is planned, and said, not silent
    assert m.tensor_parallel_sizes == (1,) and m.tp_source == "default"
    assert len(m.warnings) == 1 and "names no tensor-parallel sizes" in m.warnings[0] and "--tp" in m.warnings[0]
    full = with_tensor_parallel(m, [8, 4, 2, 1])
    assert full.tensor_parallel_sizes == (1, 2, 4, 8) and full.tp_source == "--tp" and full.warnings == ()
    h200 = [get_target("h200")]
    assert [e.variant for e in plan_model(full, h200)] == [e.variant for e in plan_model(load_config(), h200)]


# A checkpoint's dtype is how its weights were saved; the kernels serve bf16 whatever it is. "dtype" (transformers
# >= 4.56) wins over "torch_dtype"; a wrapper's text_config wins over its top level.
@pytest.mark.parametrize("patch,ckpt", [
    ({"torch_dtype": "float32"}, "float32"), ({"torch_dtype": "float16"}, "float16"),
    ({"torch_dtype": "bfloat16"}, "bfloat16"), ({"dtype": "float16"}, "float16"),
    ({"dtype": "float32", "torch_dtype": "bfloat16"}, "float32"), ({}, "bfloat16"),
])
def test_checkpoint_dtype_is_not_the_serving_dtype(patch, ckpt):
    m = parse_config({**BASE, **patch})
    assert m.checkpoint_dtype == ckpt and m.dtype == "bfloat16"


@pytest.mark.parametrize("head_dim", [None, "absent"])
def test_head_dim_null_or_absent_is_derived(head_dim):
    d = dict(BASE)
    if head_dim == "absent":
        del d["head_dim"]
    else:
        d["head_dim"] = None
    assert parse_config(d).head_dim == 8192 // 128


def test_kv_heads_absent_means_one_per_head():  # HF's rule (multi-head attention)
    d = {k: v for k, v in BASE.items() if k != "num_key_value_heads"}
    assert parse_config(d).num_key_value_heads == 128


def test_text_config_errors_name_the_nested_key(tmp_path):
    wrapper = json.loads((DATA / "multimodal_wrapper.json").read_text())
    wrapper["text_config"]["head_dim"] = 128
    p = write(tmp_path, wrapper)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert ei.value.key == "text_config.head_dim" and f"{p}: text_config.head_dim: must be 64" in str(ei.value)


def test_tp_override_is_validated_like_the_config():
    m = load_config()
    assert with_tensor_parallel(m, [8]).tensor_parallel_sizes == (8,)
    for bad, reason in (([3], "does not divide num_attention_heads"), ([], "non-empty"), ([2, 2], "duplicate"),
                        ([0], ">= 1")):
        with pytest.raises(ConfigError, match=reason) as ei:
            with_tensor_parallel(m, bad)
        assert ei.value.source == "--tp"


def test_a_config_with_tp_sizes_has_no_warning():
    assert load_config().warnings == () and load_config().tp_source == "config"


def test_bad_json_names_line(tmp_path):
    with pytest.raises(ConfigError, match=r"cfg.json: invalid JSON at line 2"):
        load_config(write(tmp_path, '{\n "hidden_size": ,\n}'))


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.json")


def test_top_level_not_object(tmp_path):
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(write(tmp_path, "[1, 2]"))
