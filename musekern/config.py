"""Model config (cfg.json): a model's published HF `config.json` plus an optional `musekern` block,
validated into frozen dataclasses.

Read as published: a multimodal wrapper's `text_config` holds the language model's fields (errors name
them `text_config.<key>`); `head_dim` null or absent is hidden_size / num_attention_heads;
`num_key_value_heads` null or absent is num_attention_heads (HF's rule); `dtype` (newer transformers) or
`torch_dtype` names the checkpoint's dtype (float32, float16 or bfloat16): the kernels serve bfloat16
whatever the checkpoint was saved in; `rope_theta` may sit in `rope_parameters`. Unknown keys are
ignored; bad values raise ConfigError naming the file, the key and the reason.

The `musekern` block (top level): `tensor_parallel_sizes`, `max_decode_tokens`, `targets`. A config
that names no TP sizes plans TP 1 and says so in `ModelConfig.warnings`; `with_tensor_parallel`
applies `--tp`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from .model import FRONT_MAX_TOKENS
from .model import HEAD_DIM as QKV_FRONT_HEAD_DIM
from .model import HIDDEN as QKV_FRONT_HIDDEN
from .targets import OTHER_DEVICES, TARGETS, supported_targets, unsupported_reason

DEFAULT_CONFIG_NAME = "muse_spark.json"


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
    dtype: str = "bfloat16"  # what the kernels are built for (musekern serves bf16, whatever the checkpoint)
    checkpoint_dtype: str = "bfloat16"  # the config's `dtype` / `torch_dtype`: how the weights were saved
    tp_source: str = "config"  # where tensor_parallel_sizes came from: "config", "--tp", or "default"

    def shard(self, tp: int) -> ShardShape:
        nq = self.num_attention_heads // tp
        nkv = max(1, self.num_key_value_heads // tp)  # kv heads replicate when tp > kv heads
        return ShardShape(tp, nq, nkv, self.head_dim, self.attn_output_gate)

    def shards(self) -> tuple[ShardShape, ...]:
        return tuple(self.shard(tp) for tp in self.tensor_parallel_sizes)

    @property
    def warnings(self) -> tuple[str, ...]:
        """What every command that plans says on stderr and in its --json output."""
        if self.tp_source == "default":
            return (f"{self.source} names no tensor-parallel sizes (musekern.tensor_parallel_sizes): planning "
                    f"TP 1 only, so a server sharded TP 2/4/8 would miss its kernels; pass --tp with the sizes "
                    f"you serve, e.g. --tp 1,2,4,8",)
        return ()


# key -> (type check, description) for the top-level fields
_INT_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
_FLOAT_KEYS = ("rms_norm_eps", "rope_theta")
_DEFAULTS = {"attn_output_gate": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "max_position_embeddings": 4096}
# max_decode_tokens defaults to model.FRONT_MAX_TOKENS; a larger value changes nothing (cuBLAS + the fused epilogue
# serve every M) but is accepted.
_MUSEKERN_DEFAULTS = {"max_decode_tokens": FRONT_MAX_TOKENS, "targets": []}
DEFAULT_TP_SIZES = (1,)
SERVING_DTYPE = "bfloat16"  # the dtype every planned kernel is built for
CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16")  # a checkpoint saved in any of these is served in bf16
SUPPORTED_DTYPES = (SERVING_DTYPE,)


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


def _check_tps(src: str, key: str, tps, nq: int, nkv: int) -> tuple[int, ...]:
    """Validated, sorted TP sizes: each divides the heads (kv heads replicate past their count)."""
    if not isinstance(tps, (list, tuple)) or not tps:
        raise ConfigError(src, key, "must be a non-empty list of integers")
    for tp in tps:
        _int(src, key, tp)
        if nq % tp:
            raise ConfigError(src, key, f"tp={tp} does not divide num_attention_heads ({nq})")
        if tp <= nkv and nkv % tp:
            raise ConfigError(src, key, f"tp={tp} does not divide num_key_value_heads ({nkv})")
        if tp > nkv and tp % nkv:
            raise ConfigError(src, key,
                              f"tp={tp} > num_key_value_heads ({nkv}) must be a multiple of it to replicate kv heads")
    if len(set(tps)) != len(tps):
        raise ConfigError(src, key, f"duplicate entries in {list(tps)}")
    return tuple(sorted(tps))


def parse_config(data, source: str = "<config>") -> ModelConfig:
    src = source
    if not isinstance(data, dict):
        raise ConfigError(src, None, f"top level must be a JSON object, got {type(data).__name__}")
    text = data.get("text_config")
    prefix = ""
    fields = data
    if text is not None:  # a multimodal wrapper: the language model's fields are in text_config
        if not isinstance(text, dict):
            raise ConfigError(src, "text_config", f"must be a JSON object, got {json.dumps(text)[:40]}")
        fields, prefix = text, "text_config."

    def key(k: str) -> str:
        return prefix + k

    for k in ("hidden_size", "num_attention_heads"):
        if k not in fields:
            raise ConfigError(src, key(k), "missing required key")
    d = dict(_DEFAULTS)
    d.update(fields)
    vals = {}
    for k in _INT_KEYS:
        if k in ("head_dim", "num_key_value_heads") and d.get(k) is None:
            continue  # absent or null: derived below, as HF does
        vals[k] = _int(src, key(k), d[k])
    if "num_key_value_heads" not in vals:  # HF: absent or null means one kv head per attention head
        vals["num_key_value_heads"] = vals["num_attention_heads"]
    if "head_dim" not in vals:  # absent or null: HF derives it
        if vals["hidden_size"] % vals["num_attention_heads"]:
            raise ConfigError(src, key("head_dim"),
                              "missing, and hidden_size is not divisible by num_attention_heads")
        vals["head_dim"] = vals["hidden_size"] // vals["num_attention_heads"]
    eps = _float(src, key("rms_norm_eps"), d["rms_norm_eps"])
    theta_key, theta = key("rope_theta"), d["rope_theta"]
    rope_params = fields.get("rope_parameters")
    if "rope_theta" not in fields and isinstance(rope_params, dict) and "rope_theta" in rope_params:
        theta_key, theta = key("rope_parameters.rope_theta"), rope_params["rope_theta"]  # transformers v5 layout
    theta = _float(src, theta_key, theta)
    gate = d["attn_output_gate"]
    if not isinstance(gate, bool):
        raise ConfigError(src, key("attn_output_gate"), f"must be true or false, got {json.dumps(gate)}")
    ckpt_dtype = _checkpoint_dtype(src, data, fields, prefix)
    nq, nkv, hd = vals["num_attention_heads"], vals["num_key_value_heads"], vals["head_dim"]
    if nq % nkv:
        raise ConfigError(src, key("num_key_value_heads"),
                          f"num_attention_heads ({nq}) is not divisible by num_key_value_heads ({nkv})")
    if hd != QKV_FRONT_HEAD_DIM:
        raise ConfigError(src, key("head_dim"), f"must be {QKV_FRONT_HEAD_DIM} for the qkv_front kernel, got {hd}")
    if vals["hidden_size"] != QKV_FRONT_HIDDEN:
        raise ConfigError(src, key("hidden_size"),
                          f"must be {QKV_FRONT_HIDDEN} for the qkv_front kernel, got {vals['hidden_size']}")
    if not gate:
        raise ConfigError(src, key("attn_output_gate"), "must be true: the qkv_front kernel's fused projection is "
                                                        "q | k | v | gate (a model without the gate is not supported)")

    mk = data.get("musekern", {})
    if not isinstance(mk, dict):
        raise ConfigError(src, "musekern", "must be a JSON object")
    m = dict(_MUSEKERN_DEFAULTS)
    m.update(mk)
    tps, tp_source = DEFAULT_TP_SIZES, "default"  # ModelConfig.warnings says so
    if "tensor_parallel_sizes" in mk:
        tps = _check_tps(src, "musekern.tensor_parallel_sizes", mk["tensor_parallel_sizes"], nq, nkv)
        tp_source = "config"
    mdt = _int(src, "musekern.max_decode_tokens", m["max_decode_tokens"])
    targets = m["targets"]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ConfigError(src, "musekern.targets", "must be a list of target names")
    for t in targets:
        name = t.strip().lower()
        if name in OTHER_DEVICES:
            raise ConfigError(src, "musekern.targets", unsupported_reason(OTHER_DEVICES[name]))
        if name not in TARGETS:
            raise ConfigError(src, "musekern.targets",
                              f"unknown target {t!r}; supported targets: {supported_targets()}")
    return ModelConfig(
        source=src, hidden_size=vals["hidden_size"], num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hd,
        attn_output_gate=gate, rms_norm_eps=eps, rope_theta=theta,
        max_position_embeddings=vals["max_position_embeddings"], tensor_parallel_sizes=tps,
        max_decode_tokens=mdt, targets=tuple(t.strip().lower() for t in targets), dtype=SERVING_DTYPE,
        checkpoint_dtype=ckpt_dtype, tp_source=tp_source)


def _checkpoint_dtype(src: str, data: dict, fields: dict, prefix: str) -> str:
    """The checkpoint's dtype: `dtype` (transformers >= 4.56) else `torch_dtype`, in text_config first.
    Absent: bfloat16. It only has to be one musekern can serve in bf16."""
    for where, pre in ((fields, prefix), (data, "")) if prefix else ((data, ""),):
        for k in ("dtype", "torch_dtype"):
            v = where.get(k)
            if v is None:
                continue
            if v not in CHECKPOINT_DTYPES:
                raise ConfigError(src, pre + k, f"unsupported dtype {json.dumps(v)}; a checkpoint in "
                                                f"{', '.join(CHECKPOINT_DTYPES)} is served in {SERVING_DTYPE}")
            return v
    return SERVING_DTYPE


def with_tensor_parallel(model: ModelConfig, tps, source: str = "--tp") -> ModelConfig:
    """`model` planned for these TP sizes instead of its own (the CLI's --tp); validated like the config's."""
    checked = _check_tps(source, "tensor_parallel_sizes", list(tps), model.num_attention_heads,
                         model.num_key_value_heads)
    return replace(model, tensor_parallel_sizes=checked, tp_source=source)


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
