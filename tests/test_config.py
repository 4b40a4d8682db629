import json

import pytest

from musekern.config import ConfigError, load_config, parse_config

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
    ({"musekern": {"targets": ["a100x"]}}, "musekern.targets", "unknown target"),
    ({"musekern": {"tensor_parallel_sizes": [3]}}, "musekern.tensor_parallel_sizes", "does not divide"),
    ({"musekern": {"tensor_parallel_sizes": []}}, "musekern.tensor_parallel_sizes", "non-empty"),
    ({"musekern": {"max_decode_tokens": 17}}, "musekern.max_decode_tokens", "<= 16"),
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
    del d["num_key_value_heads"]
    with pytest.raises(ConfigError, match="num_key_value_heads: missing required key"):
        load_config(write(tmp_path, d))


def test_bad_json_names_line(tmp_path):
    with pytest.raises(ConfigError, match=r"cfg.json: invalid JSON at line 2"):
        load_config(write(tmp_path, '{\n "hidden_size": ,\n}'))


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.json")


def test_top_level_not_object(tmp_path):
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(write(tmp_path, "[1, 2]"))
