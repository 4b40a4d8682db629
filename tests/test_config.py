import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from musekern.config import MAX_CONFIG_BYTES, ConfigError, load_config, parse_config, with_tensor_parallel
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
    with pytest.raises(ConfigError, match=r"cfg.json: is not valid JSON \(Expecting value: line 2 column 17"):
        load_config(write(tmp_path, '{\n "hidden_size": ,\n}'))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.json: no such file"):
        load_config(tmp_path / "nope.json")


def test_top_level_not_object(tmp_path):
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(write(tmp_path, "[1, 2]"))


# ---------------------------------------------------------------- issue 28 finding 5: hostile --model files
def _hostile(tmp_path, kind: str) -> Path:
    """A file of each kind a --model path may turn out to be: not a file, not text, not UTF-8, not bounded."""
    p = tmp_path / f"{kind}.json"
    good = json.dumps(BASE)
    if kind == "directory":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "link_to_dev_zero":
        p.symlink_to("/dev/zero")
    elif kind == "dangling_link":
        p.symlink_to(tmp_path / "gone")
    elif kind == "link_loop":
        p.symlink_to(p)
    elif kind == "oversize":
        with open(p, "wb") as f:
            f.truncate(MAX_CONFIG_BYTES + 1)  # sparse: 1 MiB + 1 declared, nothing read
    else:
        p.write_bytes({
            "utf16_bom": good.encode("utf-16"), "utf16le_no_bom": good.encode("utf-16-le"),
            "utf32": good.encode("utf-32"), "binary": bytes(range(256)) * 16,
            "latin1": '{"n\xe9": 1}'.encode("latin-1"), "empty": b"", "blank": b" \n\t ",
            "deep_array": b"[" * 100000 + b"]" * 100000, "deep_object": b'{"a":' * 5000 + b"1" + b"}" * 5000,
            "int_5000_digits": b'{"hidden_size": ' + b"9" * 5000 + b"}",
            "float_1e999": b'{"rms_norm_eps": 1e999}', "nan": b'{"rope_theta": NaN}', "trailing": good.encode() + b"}",
            "huge_value": json.dumps({**BASE, "num_attention_heads": "x" * 500000}).encode(),
        }[kind])
    return p


# Every kind of file that is not a config: each a ConfigError of one short line that names the file and why,
# within a second (a FIFO used to hang, /dev/zero to read until MemoryError, deep nesting to raise RecursionError,
# a 5,000-digit integer ValueError, UTF-16 UnicodeDecodeError: tracebacks).
@pytest.mark.parametrize("kind,reason", [
    ("directory", "is a directory"), ("fifo", "is a FIFO"), ("link_to_dev_zero", "is a character device"),
    ("dangling_link", "no such file"), ("link_loop", "symbolic link"), ("oversize", "more than the 1048576"),
    ("utf16_bom", "UTF-16"), ("utf16le_no_bom", "UTF-16"), ("utf32", "UTF-32"), ("binary", "NUL byte at byte 0"),
    ("latin1", "not UTF-8 text"), ("empty", "is empty"), ("blank", "is empty"), ("deep_array", "nests deeper than 32"),
    ("deep_object", "nests deeper than 32"), ("int_5000_digits", "integer of 5000 digits"),
    ("float_1e999", "out of range"), ("nan", "NaN is not JSON"), ("trailing", "Extra data"),
    ("huge_value", "must be an integer, got \"xxx"),
])
def test_a_hostile_model_file_is_one_line(tmp_path, kind, reason):
    p = _hostile(tmp_path, kind)
    out: list = []
    t = threading.Thread(target=lambda: out.append(_error_of(p)), daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(10)
    assert not t.is_alive(), f"{kind}: still reading after 10 s"
    assert time.monotonic() - t0 < 2
    (msg,) = out
    assert msg.startswith(f"{p}: ") and reason in msg and "\n" not in msg and len(msg) < 300, msg


def _error_of(p) -> str:
    try:
        load_config(p)
    except ConfigError as e:
        return str(e)
    except BaseException as e:  # noqa: BLE001 - what the test reports: a traceback-worthy escape
        return f"escaped: {type(e).__name__}: {str(e)[:200]}"
    return "loaded"


def test_dev_zero_is_refused_without_reading():
    """Before: /dev/zero read until MemoryError (1.8 GB in 6 s here). Under a 1 GiB address-space cap it must
    be a one-line error at once."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
            "from musekern.config import load_config; load_config('/dev/zero')")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30
    assert "ConfigError: /dev/zero: is a character device, not a regular file" in r.stderr
    assert "MemoryError" not in r.stderr


# What a published config may look like and still load: a UTF-8 byte-order mark, a symlink to it (the HF hub cache
# keeps config.json as a symlink into blobs/), deep-looking brackets inside a string.
@pytest.mark.parametrize("kind", ["bom", "symlink", "brackets_in_a_string"])
def test_what_a_published_config_may_hold_loads(tmp_path, kind):
    target = write(tmp_path, {**BASE, "note": "[" * 100}, "blob")
    p = tmp_path / "config.json"
    if kind == "bom":
        p.write_bytes(b"\xef\xbb\xbf" + target.read_bytes())
    elif kind == "symlink":
        p.symlink_to(target)
    else:
        p = target
    assert load_config(p).num_key_value_heads == 8


# ---------------------------------------------------------------- issue 28 finding 7: how configs name their heads
# Synthetic configs shaped like published ones, each at Muse Spark's 8192 / 128 heads / head_dim 64 so only the
# naming differs. Expected KV heads and N at TP 1 ((128 + 2 kv + 128) * 64: 8 kv 17408, 1 kv 16512, 128 kv 32768).
GATE = {"attn_output_gate": True}
FALCON_40B = {"hidden_size": 8192, "num_attention_heads": 128, "num_kv_heads": 8, "new_decoder_architecture": True,
              "multi_query": True, **GATE}  # FalconConfig's multi_query defaults true: the new architecture ignores it
FALCON_RW = {"hidden_size": 8192, "n_head": 128, "n_head_kv": 8, **GATE}  # the RefinedWeb configs
FALCON_7B = {"hidden_size": 8192, "n_head": 128, "multi_query": True, **GATE}
STARCODER = {"n_embd": 8192, "n_head": 128, "multi_query": True, **GATE}  # GPTBigCode
GPTJ = {"n_embd": 8192, "n_head": 128, "rotary_dim": 64, **GATE}  # no kv count: multi-head
MPT_GQA = {"d_model": 8192, "n_heads": 128, "attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 8},
           **GATE}
MPT_MHA = {"d_model": 8192, "n_heads": 128, "attn_config": {"attn_type": "multihead_attention", "kv_n_heads": 8},
           **GATE}  # llm-foundry reads kv_n_heads only for grouped-query attention
MPT_MQA = {"d_model": 8192, "n_heads": 128, "attn_config": {"attn_type": "multiquery_attention"}, **GATE}
DBRX = {"d_model": 8192, "n_heads": 128, "attn_config": {"kv_n_heads": 8, "clip_qkv": 8}, **GATE}
CHATGLM = {"hidden_size": 8192, "num_attention_heads": 128, "kv_channels": 64, "multi_query_attention": True,
           "multi_query_group_num": 8, **GATE}
CHATGLM_MHA = {**CHATGLM, "multi_query_attention": False}  # the group count is then unused (ChatGLM's rule)
WRAPPED_FALCON = {"model_type": "wrapper", "vision_config": {"num_heads": 16, "head_dim": 72},
                  "text_config": {"hidden_size": 8192, "num_attention_heads": 128, "num_kv_heads": 8, **GATE}}


@pytest.mark.parametrize("cfg,kv,n", [
    (FALCON_40B, 8, 17408), (FALCON_RW, 8, 17408), (FALCON_7B, 1, 16512), (STARCODER, 1, 16512),
    (GPTJ, 128, 32768), (MPT_GQA, 8, 17408), (MPT_MHA, 128, 32768), (MPT_MQA, 1, 16512), (DBRX, 8, 17408),
    (CHATGLM, 8, 17408), (CHATGLM_MHA, 128, 32768), (WRAPPED_FALCON, 8, 17408),
])
def test_kv_heads_under_every_published_name(cfg, kv, n):
    m = parse_config(cfg)
    assert (m.hidden_size, m.num_attention_heads, m.head_dim) == (8192, 128, 64)
    assert m.num_key_value_heads == kv and m.shard(1).n == n
    assert m.key_warnings == ()


def test_falcon_40b_plans_what_muse_spark_plans():
    """The issue: Falcon's num_kv_heads: 8 was ignored and TP 8 planned N = 4096 (128 KV heads) instead of 2176."""
    falcon = parse_config({**FALCON_40B, "musekern": BASE["musekern"]})
    h200 = [get_target("h200")]
    assert falcon.shard(8).n == 2176
    assert [e.variant for e in plan_model(falcon, h200)] == [e.variant for e in plan_model(load_config(), h200)]


# Two names for one count that disagree: an error naming the second key and both values (never a silent pick).
@pytest.mark.parametrize("cfg,key,reason", [
    ({**BASE, "num_kv_heads": 4}, "num_kv_heads", "is 4 but num_key_value_heads is 8"),
    ({**BASE, "n_head": 64}, "n_head", "is 64 but num_attention_heads is 128"),
    ({**BASE, "d_model": 4096}, "d_model", "is 4096 but hidden_size is 8192"),
    ({**BASE, "kv_channels": 128}, "kv_channels", "is 128 but head_dim is 64"),
    ({**FALCON_RW, "num_kv_heads": 8, "multi_query": True}, "multi_query", "true (1 KV head) but num_kv_heads is 8"),
    ({**MPT_MQA, "num_key_value_heads": 8}, "attn_config.attn_type", '"multiquery_attention" (1 KV head)'),
    ({"text_config": {**FALCON_RW, "num_key_value_heads": 4}}, "text_config.n_head_kv", "is 8 but text_config."
                                                                                           "num_key_value_heads is 4"),
    ({**BASE, "num_kv_heads": [8, 8, 4]}, "num_kv_heads", "but num_key_value_heads"),
    ({**{k: v for k, v in BASE.items() if k != "num_key_value_heads"}, "num_kv_heads": [8, 4]}, "num_kv_heads",
     "a per-layer list"),
    ({**{k: v for k, v in BASE.items() if k != "num_attention_heads"}}, "num_attention_heads",
     "missing required key (nor n_head, n_heads, num_heads)"),
])
def test_aliases_that_disagree_are_an_error(cfg, key, reason):
    with pytest.raises(ConfigError) as ei:
        parse_config(cfg, "cfg.json")
    assert ei.value.key == key and reason in ei.value.reason, str(ei.value)


def test_aliases_that_agree_are_fine():
    m = parse_config({**BASE, "num_kv_heads": 8, "n_head": 128, "n_embd": 8192, "num_key_value_heads": 8})
    assert (m.num_key_value_heads, m.num_attention_heads) == (8, 128) and m.key_warnings == ()


# Head-like keys nothing reads (DeepSeek's MLA ranks and head dims, a per-layer list, a wrapper's top-level count
# that text_config overrides): one warning line naming them, said with the model's other warnings.
@pytest.mark.parametrize("cfg,named", [
    ({**BASE, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "v_head_dim": 128},
     "kv_lora_rank, qk_rope_head_dim, v_head_dim look"),
    ({**BASE, "num_key_value_heads_per_layer": [8, 8, 4]}, "num_key_value_heads_per_layer looks"),
    ({"num_key_value_heads": 4, "text_config": dict(BASE)}, ": num_key_value_heads looks"),
    ({**BASE, "attn_config": {"kv_n_heads": 8, "kv_head_groups": 2}}, "attn_config.kv_head_groups looks"),
])
def test_unread_head_like_keys_warn(cfg, named):
    m = parse_config(cfg, "cfg.json")
    (w,) = m.key_warnings
    assert w.startswith("cfg.json: ") and named in w and "\n" not in w and w in m.warnings


@pytest.mark.parametrize("path", [None, DATA / "qwen3_style.json", DATA / "multimodal_wrapper.json"])
def test_known_configs_warn_about_no_key(path):
    assert load_config(path).key_warnings == ()


def test_a_wrappers_top_level_copy_of_text_config_is_no_warning():  # Qwen2.5-VL saves the text fields twice
    assert parse_config({**BASE, "text_config": dict(BASE)}).key_warnings == ()


# vLLM's kv_cache_dtype vocabulary in the musekern block: auto / bf16 / bfloat16 -> bf16 builds, fp8 / fp8_e4m3 ->
# e4m3 builds; e5m2 and anything else refused with the key and a one-line reason
@pytest.mark.parametrize("value,want", [(None, "bf16"), ("auto", "bf16"), ("bf16", "bf16"), ("bfloat16", "bf16"),
                                        ("fp8", "fp8_e4m3"), ("FP8_E4M3", "fp8_e4m3")])
def test_kv_cache_dtype(value, want):
    data = json.loads(json.dumps(BASE))
    if value is not None:
        data["musekern"]["kv_cache_dtype"] = value
    assert parse_config(data).kv_cache_dtype == want


@pytest.mark.parametrize("value,reason", [("fp8_e5m2", "fp8_e5m2 KV caches are not served"),
                                          ("int8", "unknown KV cache dtype 'int8'"), (8, "unknown KV cache dtype 8")])
def test_kv_cache_dtype_refused(value, reason):
    data = json.loads(json.dumps(BASE))
    data["musekern"]["kv_cache_dtype"] = value
    with pytest.raises(ConfigError, match="musekern.kv_cache_dtype") as e:
        parse_config(data)
    assert reason in str(e.value) and "\n" not in str(e.value)


def test_fp8_plan_is_the_bf16_plan_with_the_cache_dtype():
    """Every qkv_front / qkv_epilogue build of the FP8 plan is the bf16 plan's build with kv_cache_dtype=fp8_e4m3
    (same levers); qk_norm builds are shared; bf16 labels never name the field (its default: keys unchanged)."""
    from dataclasses import replace

    from musekern.config import with_kv_cache_dtype

    model = load_config()
    h200 = [get_target("h200")]
    bf16 = [e.variant for e in plan_model(model, h200)]
    fp8 = [e.variant for e in plan_model(with_kv_cache_dtype(model, "fp8"), h200)]
    assert not any("kv_cache_dtype" in v.label for v in bf16)
    want = {v if v.kernel == "qk_norm" else replace(v, kv_cache_dtype="fp8_e4m3") for v in bf16}
    assert set(fp8) == want and len(fp8) == len(bf16)
    assert all("kv_cache_dtype=fp8_e4m3" in v.label for v in fp8 if v.kernel != "qk_norm")


# The checkpoint's weight format (issue 30) from quantization_config, at the top level or in text_config (as
# multimodal FP8 releases save it); bf16 configs are unchanged (BF16, the same plan).
DS_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


# an FP8 checkpoint plans the FP8-weight front builds (M <= 16) of its granularity, the epilogue's and qk_norm's as a
# bf16 one, and its GEMM path's x quantization; no format warns (every GEMM path above M = 16 is W8A8; a torch that
# serves no block scaling says so where it runs: gemm/fp8.py)
def test_fp8_weights_plan_fp8_front_builds():
    h200 = [get_target("h200")]
    bf16 = plan_model(parse_config(BASE), h200)
    for qc, scale in ((DS_FP8, "block"), ({"quant_method": "fbgemm_fp8"}, "channel"),
                      ({"quant_method": "fp8"}, "channel")):
        m = parse_config({**BASE, "quantization_config": qc}, "cfg.json")
        assert not any("FP8" in x for x in m.warnings)
        entries = plan_model(m, h200)
        front = [e.variant for e in entries if e.kernel == "qkv_front"]
        assert front and {(v.weight_dtype, v.weight_scale) for v in front} == {("fp8_e4m3", scale)}
        # the rest as bf16's, and the W8A8 GEMM path's x quantization (per token for per-row scales, per group else)
        # with TP8's W8A8 front's (per group, ahead of it)
        assert [e.variant for e in entries if e.kernel not in ("qkv_front", "x_quant")] == [
            e.variant for e in bf16 if e.kernel != "qkv_front"]
        assert [e.variant.group for e in entries if e.kernel == "x_quant"] == [128] if scale == "block" else [0, 128]


@pytest.mark.parametrize("where", ["top", "text_config", "both"])
def test_weight_format_from_quantization_config(where):
    from musekern.weights.formats import BF16

    assert load_config().weight_format == BF16 and parse_config(BASE).weight_format == BF16
    data = json.loads(json.dumps(BASE))
    if where != "top":
        data["text_config"] = {k: data.pop(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                        "head_dim", "attn_output_gate")}
        data["text_config"]["quantization_config"] = DS_FP8
    if where != "text_config":
        data["quantization_config"] = DS_FP8
    f = parse_config(data).weight_format
    assert (f.dtype, f.granularity, f.block, f.source) == ("fp8_e4m3", "block", (128, 128), "fp8 (block 128x128)")


@pytest.mark.parametrize("patch,key,reason", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config.quant_method",
     "'awq' is not read; supported: bf16"),
    ({"quantization_config": {**DS_FP8, "weight_block_size": [64, 64]}}, "quantization_config.weight_block_size",
     "only [128, 128]"),
    ({"text_config": {**BASE, "quantization_config": {**DS_FP8, "fmt": "e5m2"}}}, "text_config.quantization_config.fmt",
     "only e4m3"),
    ({"quantization_config": DS_FP8, "text_config": {**BASE, "quantization_config": {"quant_method": "fbgemm_fp8"}}},
     "text_config.quantization_config", "differs from the top-level"),
    ({"num_hidden_layers": 4,
      "quantization_config": {**DS_FP8, "modules_to_not_convert": ["model.layers.2.self_attn"]}},
     "quantization_config.modules_to_not_convert", "mixes bf16 and fp8 layers"),
])
def test_weight_format_refused_names_file_key_reason(tmp_path, patch, key, reason):
    p = write(tmp_path, {**BASE, **patch})
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    e = ei.value
    assert e.source == str(p) and e.key == key and reason in e.reason and "\n" not in str(e), str(e)


def test_weight_format_attention_kept_bf16_reads_num_hidden_layers():
    from musekern.weights.formats import BF16

    skip = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(4) for p in "qkvo"]
    data = {**BASE, "num_hidden_layers": 4, "quantization_config": {"quant_method": "fbgemm_fp8",
                                                                    "modules_to_not_convert": skip}}
    f = parse_config(data).weight_format
    assert f == BF16 and "modules_to_not_convert" in f.note


def test_with_weight_format_overrides_and_the_bf16_plan_is_unchanged():
    from musekern.config import with_weight_format
    from musekern.weights.formats import BF16

    model = load_config()
    assert with_weight_format(model, "auto") is model and with_weight_format(model, "bf16").weight_format == BF16
    fp8 = with_weight_format(model, "fp8-channel")
    assert (fp8.weight_format.dtype, fp8.weight_format.granularity) == ("fp8_e4m3", "channel")
    qc = parse_config({**BASE, "quantization_config": DS_FP8})
    assert with_weight_format(qc, "auto").weight_format.granularity == "block"
    assert with_weight_format(qc, "bf16").weight_format == BF16
    with pytest.raises(ValueError, match="choose one of auto, bf16, fp8-block"):
        with_weight_format(model, "int4")
    h200 = [get_target("h200")]  # a bf16 front plans what it planned before the field existed
    assert [e.variant for e in plan_model(model, h200)] == [e.variant for e in plan_model(
        with_weight_format(qc, "bf16"), h200)]
