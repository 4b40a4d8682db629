"""Model config (cfg.json): HF-style JSON plus a `musekern` block, validated into frozen dataclasses.

Unknown keys are ignored; bad values raise ConfigError naming the file, the key and the reason.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .targets import TARGETS

DEFAULT_CONFIG_NAME = "muse_spark.json"
QKV_FRONT_HEAD_DIM = 64  # the qkv_front kernel owns one 64-column head per cluster
QKV_FRONT_HIDDEN = 8192  # the K the qkv_front kernel is built for (Muse Spark's hidden size)


class ConfigError(ValueError):
    def __init__(self, source: str, key: str | None, reason: str):
        self.source, self.key, self.reason = source, key, reason
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class ShardShape:
    """One tensor-parallel rank's share of the attention front."""
    tp: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    gate: bool

    @property
    def heads(self) -> int:
        """64-column heads of the fused projection: q | k | v | gate."""
        return 2 * self.num_q_heads + 2 * self.num_kv_heads if self.gate else self.num_q_heads + 2 * self.num_kv_heads

    @property
    def n(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True)
class ModelConfig:
    source: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attn_output_gate: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tensor_parallel_sizes: tuple[int, ...]
    max_decode_tokens: int
    targets: tuple[str, ...]
    dtype: str = "bfloat16"

    def shard(self, tp: int) -> ShardShape:
        nq = self.num_attention_heads // tp
        nkv = max(1, self.num_key_value_heads // tp)  # kv heads replicate when tp > kv heads
        return ShardShape(tp, nq, nkv, self.head_dim, self.attn_output_gate)

    def shards(self) -> tuple[ShardShape, ...]:
        return tuple(self.shard(tp) for tp in self.tensor_parallel_sizes)


# key -> (type check, description) for the top-level fields
_INT_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
_FLOAT_KEYS = ("rms_norm_eps", "rope_theta")
_DEFAULTS = {"attn_output_gate": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
_MUSEKERN_DEFAULTS = {"tensor_parallel_sizes": [1], "max_decode_tokens": 16, "targets": []}
SUPPORTED_DTYPES = ("bfloat16",)
MAX_DECODE_TOKENS = 16  # qkv_front serves 1 <= M <= 16


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(src, key, v, minimum=1):
    if not _is_int(v):
        raise ConfigError(src, key, f"must be an integer, got {json.dumps(v)}")
    if v < minimum:
        raise ConfigError(src, key, f"must be >= {minimum}, got {v}")
    return v


def _float(src, key, v, positive=True):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(src, key, f"must be a finite number, got {json.dumps(v)}")
    if positive and v <= 0:
        raise ConfigError(src, key, f"must be > 0, got {v}")
    return float(v)


def parse_config(data, source: str = "<config>") -> ModelConfig:
    src = source
    if not isinstance(data, dict):
        raise ConfigError(src, None, f"top level must be a JSON object, got {type(data).__name__}")
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads"):
        if k not in data:
            raise ConfigError(src, k, "missing required key")
    d = dict(_DEFAULTS)
    d.update(data)
    vals = {k: _int(src, k, d[k]) for k in _INT_KEYS if k in d}
    if "head_dim" not in d:
        if vals["hidden_size"] % vals["num_attention_heads"]:
            raise ConfigError(src, "head_dim", "missing, and hidden_size is not divisible by num_attention_heads")
        vals["head_dim"] = vals["hidden_size"] // vals["num_attention_heads"]
    eps = _float(src, "rms_norm_eps", d["rms_norm_eps"])
    theta = _float(src, "rope_theta", d["rope_theta"])
    gate = d["attn_output_gate"]
    if not isinstance(gate, bool):
        raise ConfigError(src, "attn_output_gate", f"must be true or false, got {json.dumps(gate)}")
    dtype = d["torch_dtype"]
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(src, "torch_dtype", f"unsupported dtype {json.dumps(dtype)}; supported: {SUPPORTED_DTYPES}")
    nq, nkv, hd = vals["num_attention_heads"], vals["num_key_value_heads"], vals["head_dim"]
    if nq % nkv:
        raise ConfigError(src, "num_key_value_heads",
                          f"num_attention_heads ({nq}) is not divisible by num_key_value_heads ({nkv})")
    if hd != QKV_FRONT_HEAD_DIM:
        raise ConfigError(src, "head_dim", f"must be {QKV_FRONT_HEAD_DIM} for the qkv_front kernel, got {hd}")
    if vals["hidden_size"] != QKV_FRONT_HIDDEN:
        raise ConfigError(src, "hidden_size",
                          f"must be {QKV_FRONT_HIDDEN} for the qkv_front kernel, got {vals['hidden_size']}")
    if not gate:
        raise ConfigError(src, "attn_output_gate", "must be true: the qkv_front kernel's fused projection is "
                                                   "q | k | v | gate (a model without the gate is not supported)")

    mk = data.get("musekern", {})
    if not isinstance(mk, dict):
        raise ConfigError(src, "musekern", "must be a JSON object")
    m = dict(_MUSEKERN_DEFAULTS)
    m.update(mk)
    tps = m["tensor_parallel_sizes"]
    if not isinstance(tps, list) or not tps:
        raise ConfigError(src, "musekern.tensor_parallel_sizes", "must be a non-empty list of integers")
    for tp in tps:
        _int(src, "musekern.tensor_parallel_sizes", tp)
        if nq % tp:
            raise ConfigError(src, "musekern.tensor_parallel_sizes",
                              f"tp={tp} does not divide num_attention_heads ({nq})")
        if tp <= nkv and nkv % tp:
            raise ConfigError(src, "musekern.tensor_parallel_sizes",
                              f"tp={tp} does not divide num_key_value_heads ({nkv})")
        if tp > nkv and tp % nkv:
            raise ConfigError(src, "musekern.tensor_parallel_sizes",
                              f"tp={tp} > num_key_value_heads ({nkv}) must be a multiple of it to replicate kv heads")
    if len(set(tps)) != len(tps):
        raise ConfigError(src, "musekern.tensor_parallel_sizes", f"duplicate entries in {tps}")
    mdt = _int(src, "musekern.max_decode_tokens", m["max_decode_tokens"])
    if mdt > MAX_DECODE_TOKENS:
        raise ConfigError(src, "musekern.max_decode_tokens", f"must be <= {MAX_DECODE_TOKENS}, got {mdt}")
    targets = m["targets"]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ConfigError(src, "musekern.targets", "must be a list of target names")
    for t in targets:
        if t.lower() not in TARGETS:
            raise ConfigError(src, "musekern.targets", f"unknown target {t!r}; known: {', '.join(sorted(TARGETS))}")
    return ModelConfig(
        source=src, hidden_size=vals["hidden_size"], num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hd,
        attn_output_gate=gate, rms_norm_eps=eps, rope_theta=theta,
        max_position_embeddings=vals["max_position_embeddings"], tensor_parallel_sizes=tuple(sorted(tps)),
        max_decode_tokens=mdt, targets=tuple(t.lower() for t in targets), dtype=dtype)


def load_config(path: str | Path | None = None) -> ModelConfig:
    """Load and validate cfg.json; `None` loads the bundled default Muse Spark config."""
    if path is None:
        text = resources.files("musekern.data").joinpath(DEFAULT_CONFIG_NAME).read_text()
        return parse_config(json.loads(text), f"<bundled {DEFAULT_CONFIG_NAME}>")
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(str(p), None, f"cannot read: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(str(p), None, f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return parse_config(data, str(p))
