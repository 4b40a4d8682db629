"""Model config (cfg.json): a model's published HF `config.json` plus an optional `musekern` block,
validated into frozen dataclasses.

Read as published, and bounded (`read_config_file`: any file that is not UTF-8 JSON is a one-line error): a
multimodal wrapper's `text_config` holds the language model's fields (errors name
them `text_config.<key>`); `head_dim` null or absent is hidden_size / num_attention_heads;
`num_key_value_heads` null or absent is num_attention_heads (HF's rule); `dtype` (newer transformers) or
`torch_dtype` names the checkpoint's dtype (float32, float16 or bfloat16): the kernels serve bfloat16
whatever the checkpoint was saved in; `rope_theta` may sit in `rope_parameters`. The other names published
configs give the head counts and sizes are read too (`_ALIASES`, `_kv_heads`: Falcon's `num_kv_heads`,
`multi_query`, MPT's `attn_config`, GPT-2's `n_head`/`n_embd`, ...); two that disagree are an error, and a
head-like key that is not read is a warning. Other unknown keys are ignored; bad values raise ConfigError
naming the file, the key and the reason.

The `musekern` block (top level): `tensor_parallel_sizes`, `max_decode_tokens`, `targets`,
`kv_cache_dtype` (vLLM's: "auto" / "bf16" = a bf16 KV cache, "fp8" / "fp8_e4m3" = e4m3 with per-tensor
scales; musekern/kv_cache.py). A config that names no TP sizes plans TP 1 and says so in
`ModelConfig.warnings`; `with_tensor_parallel` applies `--tp`, `with_kv_cache_dtype` `--kv-cache-dtype`.

`quantization_config` (top level, else text_config's) names the checkpoint's weight format (`weight_format`:
musekern/weights/formats.py; BF16 where there is none); `with_weight_format` applies an override (`--weight-format`).
An FP8 format plans the FP8-weight front builds (M <= 16; the GEMM path above); block scales warn that the GEMM path
is the slow one.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from . import kv_cache
from .model import FRONT_MAX_TOKENS
from .model import HEAD_DIM as QKV_FRONT_HEAD_DIM
from .model import HIDDEN as QKV_FRONT_HIDDEN
from .targets import OTHER_DEVICES, TARGETS, supported_targets, unsupported_reason
from .weights import formats as weight_formats

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
    key_warnings: tuple[str, ...] = ()  # head-like keys the config has and musekern does not read
    kv_cache_dtype: str = kv_cache.BF16  # the KV cache the builds write (kv_cache.KV_CACHE_DTYPES)
    weight_format: weight_formats.WeightFormat = weight_formats.BF16  # how the checkpoint stores q|k|v|gate

    def shard(self, tp: int) -> ShardShape:
        nq = self.num_attention_heads // tp
        nkv = max(1, self.num_key_value_heads // tp)  # kv heads replicate when tp > kv heads
        return ShardShape(tp, nq, nkv, self.head_dim, self.attn_output_gate)

    def shards(self) -> tuple[ShardShape, ...]:
        return tuple(self.shard(tp) for tp in self.tensor_parallel_sizes)

    @property
    def warnings(self) -> tuple[str, ...]:
        """What every command that plans says on stderr and in its --json output."""
        out = self.key_warnings
        if self.tp_source == "default":
            out += (f"{self.source} names no tensor-parallel sizes (musekern.tensor_parallel_sizes): planning TP 1 "
                    f"only, so a server sharded TP 2/4/8 would miss its kernels; pass --tp with the sizes you serve, "
                    f"e.g. --tp 1,2,4,8",)
        return out


# key -> (type check, description) for the top-level fields
_FLOAT_KEYS = ("rms_norm_eps", "rope_theta")
_DEFAULTS = {"attn_output_gate": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "max_position_embeddings": 4096}
# max_decode_tokens defaults to model.FRONT_MAX_TOKENS; a larger value changes nothing (cuBLAS + the fused epilogue
# serve every M) but is accepted.
_MUSEKERN_DEFAULTS = {"max_decode_tokens": FRONT_MAX_TOKENS, "targets": [], "kv_cache_dtype": "auto"}
DEFAULT_TP_SIZES = (1,)
SERVING_DTYPE = "bfloat16"  # the dtype every planned kernel is built for
CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16")  # a checkpoint saved in any of these is served in bf16
SUPPORTED_DTYPES = (SERVING_DTYPE,)


def _show(v, width: int = 40) -> str:
    """A config value in an error: its JSON, cut to `width` characters (a 1 MiB string stays one short line)."""
    text = json.dumps(v)
    return text if len(text) <= width else text[:width - 3] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(src, key, v, minimum=1):
    if not _is_int(v):
        per_layer = " (a per-layer list: musekern plans one count for every layer)" if isinstance(v, list) else ""
        raise ConfigError(src, key, f"must be an integer, got {_show(v)}{per_layer}")
    if v < minimum:
        raise ConfigError(src, key, f"must be >= {minimum}, got {v}")
    return v


def _float(src, key, v, positive=True):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(src, key, f"must be a finite number, got {_show(v)}")
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


# Each field under HF's name first, then the names other published configs give it (GPT-2/GPT-J/StarCoder: n_head,
# n_embd; BLOOM: n_embed; MPT/DBRX: n_heads, d_model; T5: num_heads, d_model, d_kv; ChatGLM/Qwen-1: kv_channels).
# All that are set (null is unset) must agree; errors name the first set, in this order.
_ALIASES = {
    "hidden_size": ("hidden_size", "n_embd", "n_embed", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "head_dim": ("head_dim", "kv_channels", "d_kv"),
}
# every key below is read (or deliberately passed over by its model's own rule); any other head-like key warns
_KV_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
_READ_KEYS = frozenset(k for names in _ALIASES.values() for k in names) | {
    *_KV_KEYS, "multi_query", "new_decoder_architecture", "multi_query_attention", "multi_query_group_num",
    "attn_config.kv_n_heads", "attn_config.attn_type"}
_HEADLIKE = re.compile(r"head|(^|_)kv(_|$)|key_value|query_group", re.IGNORECASE)


def _pick(src: str, fields: dict, prefix: str, names) -> tuple[str, object] | None:
    """(key, value) of the first of `names` set in `fields`; ConfigError when two set ones disagree."""
    found = [(k, fields[k]) for k in names if fields.get(k) is not None]
    for k, v in found[1:]:
        _agree(src, prefix, found[0], (k, v))
    return found[0] if found else None


def _agree(src: str, prefix: str, first: tuple, other: tuple) -> None:
    """ConfigError unless two (key, value[, how it reads]) name the same count."""
    (k0, v0, *how0), (k, v, *how) = first, other
    if v != v0 or type(v) is not type(v0):
        raise ConfigError(src, prefix + k, f"is {how[0] if how else _show(v)} but {prefix + k0} is "
                                           f"{how0[0] if how0 else _show(v0)}: both name the same count; remove one "
                                           "or make them agree")


def _kv_heads(src: str, fields: dict, prefix: str) -> tuple[str, object] | None:
    """(key, KV heads) from every way published configs name them, or None (then HF's rule: one per head).

    num_key_value_heads (HF), num_kv_heads (Falcon), n_head_kv (Falcon's RW and phi-1 configs);
    multi_query_group_num when multi_query_attention is true (ChatGLM); MPT/DBRX's attn_config: kv_n_heads
    unless attn_type is multihead_attention, 1 for multiquery_attention; multi_query: true is 1 KV head
    (StarCoder, Falcon-7B) unless new_decoder_architecture is true (Falcon-40B/180B: num_kv_heads counts).
    All that are given must agree."""
    found = [(k, fields[k]) for k in _KV_KEYS if fields.get(k) is not None]
    if fields.get("multi_query_attention") is True:
        found.append(("multi_query_group_num", fields.get("multi_query_group_num", 1)))  # ChatGLM's default: 1
    attn = fields.get("attn_config")
    if isinstance(attn, dict):
        kind = attn.get("attn_type")
        if kind == "multiquery_attention":
            found.append(("attn_config.attn_type", 1, '"multiquery_attention" (1 KV head)'))
        elif kind != "multihead_attention" and (attn.get("kv_n_heads") is not None or kind is not None):
            found.append(("attn_config.kv_n_heads", attn.get("kv_n_heads", 1)))  # llm-foundry's default: 1
    if fields.get("multi_query") is True and fields.get("new_decoder_architecture") is not True:
        found.append(("multi_query", 1, "true (1 KV head)"))
    for other in found[1:]:
        _agree(src, prefix, found[0], other)
    return found[0][:2] if found else None


def _unread_keys(data: dict, fields: dict, prefix: str) -> tuple[str, ...]:
    """The head-like keys with a count in them (an integer, or a per-layer list) that nothing reads: in the text
    fields and MPT's attn_config (but for the keys read there), and at a wrapper's top level (none is read there;
    a copy of text_config's value, as Qwen2.5-VL saves, is no news)."""
    attn = fields.get("attn_config")
    places = [(fields, "", prefix), (attn, "attn_config.", prefix + "attn_config.")] + ([(data, None, "")] if prefix
                                                                                         else [])
    out = []
    for where, read_as, shown in places:
        for k, v in where.items() if isinstance(where, dict) else ():
            count = _is_int(v) or isinstance(v, list) and v and all(_is_int(x) for x in v)
            unread = fields.get(k) != v if read_as is None else read_as + k not in _READ_KEYS
            if count and _HEADLIKE.search(k) and unread:
                out.append(shown + k[:40])
    return tuple(out)


def _key_warnings(src: str, keys: tuple[str, ...]) -> tuple[str, ...]:
    if not keys:
        return ()
    named = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
    return (f"{src}: {named} look{'s' if len(keys) == 1 else ''} like attention-head settings musekern does not "
            f"read (it plans from the head counts and head_dim only): check that `musekern plan` shows this "
            f"model's shapes",)


def parse_config(data, source: str = "<config>") -> ModelConfig:
    src = source
    if not isinstance(data, dict):
        raise ConfigError(src, None, f"top level must be a JSON object, got {type(data).__name__}")
    text = data.get("text_config")
    prefix = ""
    fields = data
    if text is not None:  # a multimodal wrapper: the language model's fields are in text_config
        if not isinstance(text, dict):
            raise ConfigError(src, "text_config", f"must be a JSON object, got {_show(text)}")
        fields, prefix = text, "text_config."

    def key(k: str) -> str:
        return prefix + k

    d = dict(_DEFAULTS)
    d.update(fields)
    vals, names = {}, {}  # field -> value, and the key it was read from (for errors)
    for field, aliases in _ALIASES.items():
        got = _pick(src, fields, prefix, aliases)
        if got is None and field != "head_dim":  # head_dim absent or null: derived below, as HF does
            if field in fields:
                _int(src, key(field), fields[field])  # null where a count must be: "got null"
            raise ConfigError(src, key(field), "missing required key" + (
                f" (nor {', '.join(aliases[1:])})" if len(aliases) > 1 else ""))
        if got is not None:
            names[field] = got[0]
            vals[field] = _int(src, key(got[0]), got[1])
    vals["max_position_embeddings"] = _int(src, key("max_position_embeddings"), d["max_position_embeddings"])
    got = _kv_heads(src, fields, prefix)
    names["num_key_value_heads"] = got[0] if got else "num_key_value_heads"
    # HF: absent or null means one kv head per attention head
    vals["num_key_value_heads"] = _int(src, key(got[0]), got[1]) if got else vals["num_attention_heads"]
    if "head_dim" not in vals:  # absent or null: HF derives it
        if vals["hidden_size"] % vals["num_attention_heads"]:
            raise ConfigError(src, key("head_dim"), f"missing, and {names['hidden_size']} is not divisible by "
                                                    f"{names['num_attention_heads']}")
        vals["head_dim"] = vals["hidden_size"] // vals["num_attention_heads"]
    eps = _float(src, key("rms_norm_eps"), d["rms_norm_eps"])
    theta_key, theta = key("rope_theta"), d["rope_theta"]
    rope_params = fields.get("rope_parameters")
    if "rope_theta" not in fields and isinstance(rope_params, dict) and "rope_theta" in rope_params:
        theta_key, theta = key("rope_parameters.rope_theta"), rope_params["rope_theta"]  # transformers v5 layout
    theta = _float(src, theta_key, theta)
    gate = d["attn_output_gate"]
    if not isinstance(gate, bool):
        raise ConfigError(src, key("attn_output_gate"), f"must be true or false, got {_show(gate)}")
    ckpt_dtype = _checkpoint_dtype(src, data, fields, prefix)
    nq, nkv, hd = vals["num_attention_heads"], vals["num_key_value_heads"], vals["head_dim"]
    if nq % nkv:
        raise ConfigError(src, key(names["num_key_value_heads"]),
                          f"{names['num_attention_heads']} ({nq}) is not divisible by the KV heads ({nkv})")
    if hd != QKV_FRONT_HEAD_DIM:
        raise ConfigError(src, key(names.get("head_dim", "head_dim")),
                          f"must be {QKV_FRONT_HEAD_DIM} for the qkv_front kernel, got {hd}")
    if vals["hidden_size"] != QKV_FRONT_HIDDEN:
        raise ConfigError(src, key(names["hidden_size"]),
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
                              f"unknown target {_show(t)}; supported targets: {supported_targets()}")
    kv = _kv_cache_dtype(src, "musekern.kv_cache_dtype", m["kv_cache_dtype"])
    wf = _weight_format(src, data, fields, prefix)
    return ModelConfig(
        source=src, hidden_size=vals["hidden_size"], num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hd,
        attn_output_gate=gate, rms_norm_eps=eps, rope_theta=theta,
        max_position_embeddings=vals["max_position_embeddings"], tensor_parallel_sizes=tps,
        max_decode_tokens=mdt, targets=tuple(t.strip().lower() for t in targets), dtype=SERVING_DTYPE,
        checkpoint_dtype=ckpt_dtype, tp_source=tp_source, kv_cache_dtype=kv, weight_format=wf,
        key_warnings=_key_warnings(src, _unread_keys(data, fields, prefix)))


def _kv_cache_dtype(src: str, key: str, value) -> str:
    try:
        return kv_cache.resolve(value)
    except ValueError as e:
        raise ConfigError(src, key, str(e)) from None


def _weight_format(src: str, data: dict, fields: dict, prefix: str) -> weight_formats.WeightFormat:
    """The `quantization_config` at the top level, else in text_config (two that differ are an error), parsed by
    weights/formats.py; its UnsupportedWeightFormat becomes a ConfigError naming the same key."""
    top, nested = data.get("quantization_config"), fields.get("quantization_config") if prefix else None
    if top is not None and nested is not None and top != nested:
        raise ConfigError(src, prefix + "quantization_config", "differs from the top-level quantization_config: "
                                                               "remove one or make them agree")
    qc, pre = (top, "") if top is not None else (nested, prefix)
    layers = fields.get("num_hidden_layers")
    try:
        return weight_formats.parse_quantization_config(qc, src, num_layers=layers if _is_int(layers) else None)
    except weight_formats.UnsupportedWeightFormat as e:
        raise ConfigError(src, pre + e.key if e.key else None, e.reason) from None


def _checkpoint_dtype(src: str, data: dict, fields: dict, prefix: str) -> str:
    """The checkpoint's dtype: `dtype` (transformers >= 4.56) else `torch_dtype`, in text_config first.
    Absent: bfloat16. It only has to be one musekern can serve in bf16."""
    for where, pre in ((fields, prefix), (data, "")) if prefix else ((data, ""),):
        for k in ("dtype", "torch_dtype"):
            v = where.get(k)
            if v is None:
                continue
            if v not in CHECKPOINT_DTYPES:
                raise ConfigError(src, pre + k, f"unsupported dtype {_show(v)}; a checkpoint in "
                                                f"{', '.join(CHECKPOINT_DTYPES)} is served in {SERVING_DTYPE}")
            return v
    return SERVING_DTYPE


def with_tensor_parallel(model: ModelConfig, tps, source: str = "--tp") -> ModelConfig:
    """`model` planned for these TP sizes instead of its own (the CLI's --tp); validated like the config's."""
    checked = _check_tps(source, "tensor_parallel_sizes", list(tps), model.num_attention_heads,
                         model.num_key_value_heads)
    return replace(model, tensor_parallel_sizes=checked, tp_source=source)


def with_kv_cache_dtype(model: ModelConfig, value: str) -> ModelConfig:
    """`model` planned for this KV cache dtype (the CLI's --kv-cache-dtype: auto, bf16, fp8, fp8_e4m3; ValueError
    with the reason otherwise)."""
    return replace(model, kv_cache_dtype=kv_cache.resolve(value))


def with_weight_format(model: ModelConfig, value: str) -> ModelConfig:
    """`model` with this weight format instead of its config's (an override: weights.formats.OVERRIDE_CHOICES;
    "auto" keeps the config's; ValueError with the choices otherwise)."""
    wf = weight_formats.parse_override(value)
    return model if wf is None else replace(model, weight_format=wf)


MAX_CONFIG_BYTES = 1 << 20  # a published config.json is 1-20 KB; the largest label maps stay under 1 MiB
_UTF16_32 = (b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")  # byte-order marks of UTF-16/32 (LE first: UTF-32 LE too)


def read_config_file(path: str | Path):
    """The JSON value of the config file `path`, read bounded (store/fs.read_regular, store/manifest.parse_json):
    a regular file (a symlink to one is followed; a FIFO, device or directory is refused without reading), at
    most MAX_CONFIG_BYTES, UTF-8 (a UTF-8 byte-order mark is skipped), at most MAX_JSON_DEPTH levels deep,
    integers of at most 20 digits, finite numbers. Anything else raises ConfigError naming the file: one line,
    never a traceback, a hang or a MemoryError."""
    from .store.fs import ReadProblem, read_regular
    from .store.manifest import MAX_JSON_DEPTH, json_depth, parse_json

    src = str(path)
    try:
        raw = read_regular(path, MAX_CONFIG_BYTES, shown=src, follow_symlinks=True)
    except FileNotFoundError:
        raise ConfigError(src, None, "no such file; pass your model's config.json") from None
    except ReadProblem as e:
        raise ConfigError(src, None, f"{e.reason}; pass your model's config.json") from None
    raw = raw.removeprefix(b"\xef\xbb\xbf")
    nul = raw.find(b"\x00")
    if raw.startswith(_UTF16_32) or 0 <= nul < 4 and raw.isascii():
        raise ConfigError(src, None, "is UTF-16 or UTF-32 text; musekern reads UTF-8 JSON: convert it "
                                     "(e.g. iconv -f UTF-16 -t UTF-8)")
    if nul >= 0:
        raise ConfigError(src, None, f"holds a NUL byte at byte {nul}: a binary file, not JSON text")
    if not raw.strip():
        raise ConfigError(src, None, "is empty; pass your model's config.json")
    if json_depth(raw, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise ConfigError(src, None, f"nests deeper than {MAX_JSON_DEPTH} levels (a model config nests 2 to 5)")
    try:
        return parse_json(raw, "")
    except ValueError as e:  # not UTF-8, not JSON, a number too long or out of range: one line from parse_json
        raise ConfigError(src, None, str(e).strip()) from None


def load_config(path: str | Path | None = None) -> ModelConfig:
    """Load and validate cfg.json (read_config_file: bounded); `None` loads the bundled default Muse Spark config."""
    if path is None:
        text = resources.files("musekern.data").joinpath(DEFAULT_CONFIG_NAME).read_text()
        return parse_config(json.loads(text), f"<bundled {DEFAULT_CONFIG_NAME}>")
    return parse_config(read_config_file(path), str(path))
