"""The weight formats of the attention front (pure: no torch, no cutlass): which checkpoint formats musekern reads,
parsed from a config.json's `quantization_config`, or named by a command-line override.

A `WeightFormat` says how a checkpoint stores the q | k | v | gate projection weights; `pack.pack_rank` turns any
of them into one canonical device layout (e4m3 [N, 8192] + fp32 dequant multipliers). Read here (facts and sources:
research/fp8.md section 1):

- no `quantization_config` (or null): BF16, the weights as they are;
- `quant_method: "fp8"` with `weight_block_size: [128, 128]` (DeepSeek-V3/R1/V3.x, Kimi-K2, Qwen3*-FP8,
  MiniMax-M2): block scales `weight_scale_inv` [ceil(rows/128), 64] (a multiplier despite the name), fp32 or bf16;
  `scale_fmt: "ue8m0"` (DeepSeek-V3.1+): the scales are powers of two; `fmt`, if given, must be "e4m3" (or
  "float8_e4m3fn");
- `quant_method: "fp8"` without `weight_block_size` (AutoFP8, older): one `weight_scale` per tensor;
- `quant_method: "compressed-tensors"` (llm-compressor), `format` "float-quantized" (or "naive-quantized", the same
  e4m3 tensors), the config group(s) that target the attention's q/k/v with weights `num_bits: 8, type: float,
  symmetric`, strategy "block" (block_structure [128, 128] or "128x128": FP8_BLOCK), "channel" (FP8_DYNAMIC) or
  "tensor" (FP8); scales `weight_scale` in the model's dtype (usually bf16);
- `quant_method: "fbgemm_fp8"` (Llama-3.1-405B-FP8): per-channel `weight_scale` [rows, 1].

Anything else (int4/int8, AWQ, GPTQ, e5m2, other block sizes, groups that quantize q, k and v differently) raises
UnsupportedWeightFormat naming the source, the key and what is supported. Activation settings (`activation_scheme`,
`input_activations`, a static `input_scale`) are not read: how x is handled is the kernels' choice.

Layers kept in bf16 (`modules_to_not_convert`, its alias `ignored_layers`, compressed-tensors' `ignore`, or
compressed-tensors groups whose `targets` miss the attention): when they cover the q, k and v projections of every
layer, the front stays BF16 (a `WeightFormat` equal to BF16 whose `note` says why); when they cover some
projections or some layers only, the front would mix bf16 and fp8 layers: UnsupportedWeightFormat. Entries are
matched against the usual module names (model.layers.<i>.self_attn.{q,k,v}_proj, also under
model.language_model. and language_model.model.): "re:<regex>" with re.match (compressed-tensors), a pattern with
* ? [ with fnmatch (ModelOpt), any other entry as whole dotted components inside the name (transformers' substring
rule, vLLM's prefixes, compressed-tensors' exact names). The attention gate's own module (where a checkpoint has one)
is not looked for: q/k/v decide.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

DTYPES = ("bf16", "fp8_e4m3")
GRANULARITIES = ("none", "tensor", "channel", "block")
SCALE_DTYPES = ("float32", "bfloat16", "float16")  # what a checkpoint stores; pack.pack_rank upcasts each exactly
BLOCK = (128, 128)  # the one block shape read: (rows, K columns) of a scale
# the command-line override's vocabulary (parse_override): "auto" = what the config's quantization_config says
OVERRIDE_CHOICES = ("auto", "bf16", "fp8-block", "fp8-block-ue8m0", "fp8-channel", "fp8-tensor")

SUPPORTED = ("supported: bf16 (no quantization_config), or e4m3 weights with 128x128 block, per-channel or per-tensor "
             "scales: quant_method fp8 (weight_block_size [128, 128] or none), compressed-tensors float-quantized "
             "num_bits 8 type float (FP8_BLOCK, FP8_DYNAMIC, FP8), fbgemm_fp8")


class UnsupportedWeightFormat(ValueError):
    """A checkpoint format musekern does not serve: one line naming the source, the key and what is supported."""

    def __init__(self, source: str, key: str | None, reason: str):
        self.source, self.key, self.reason = source, key, reason
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint stores the front's weights. `scale_dtype`, `source` and `note` describe, they do not
    distinguish: two formats are equal when they pack to the same canonical layout under the same checks.
    `scale_dtype` is what the checkpoint is expected to store (quantize_reference writes it); pack_rank takes fp32,
    bf16 or fp16 scales whatever it says, since config.json does not tell (DeepSeek-V3 stores fp32, Qwen3-FP8 bf16
    under the same quantization_config)."""
    dtype: str = "bf16"  # DTYPES
    granularity: str = "none"  # GRANULARITIES: one scale per tensor, per row (channel), or per 128x128 block
    block: tuple[int, int] | None = None  # BLOCK where granularity is "block"
    scale_dtype: str = field(default="float32", compare=False)  # SCALE_DTYPES (the canonical scales are fp32)
    ue8m0: bool = False  # block scales are powers of two (DeepSeek-V3.1+ scale_fmt "ue8m0")
    source: str = field(default="bf16", compare=False)  # e.g. "fp8 (block 128x128)", "compressed-tensors FP8_BLOCK"
    note: str = field(default="", compare=False)  # why a quantized checkpoint's front is BF16, if it is

    def __post_init__(self):
        ok = (self.dtype in DTYPES and self.granularity in GRANULARITIES and self.scale_dtype in SCALE_DTYPES
              and (self.dtype == "bf16") == (self.granularity == "none")
              and (self.block == BLOCK) == (self.granularity == "block")
              and (not self.ue8m0 or self.granularity == "block"))
        if not ok:
            raise ValueError(f"inconsistent WeightFormat: {self!r}")

    @property
    def fp8(self) -> bool:
        return self.dtype == "fp8_e4m3"

    @property
    def kernel_scale(self) -> str:
        """How the kernels apply the canonical scales (pack.py): "none" (bf16), "block" (one per 64 rows x 128 K),
        "channel" (one per row: per-channel and per-tensor checkpoints pack to it)."""
        return {"none": "none", "block": "block"}.get(self.granularity, "channel")

    @property
    def name(self) -> str:
        """The override spelling of this format (OVERRIDE_CHOICES): parse_override(f.name) == f."""
        if not self.fp8:
            return "bf16"
        return f"fp8-{self.granularity}" + ("-ue8m0" if self.ue8m0 else "")


BF16 = WeightFormat()


def _fp8(granularity: str, source: str, scale_dtype: str = "float32", ue8m0: bool = False) -> WeightFormat:
    return WeightFormat("fp8_e4m3", granularity, BLOCK if granularity == "block" else None, scale_dtype, ue8m0,
                        source)


def parse_override(value: str) -> WeightFormat | None:
    """A command-line override (OVERRIDE_CHOICES): None for "auto" (use the config), else the format; ValueError
    with the choices otherwise."""
    v = value.strip().lower() if isinstance(value, str) else value
    if v == "auto":
        return None
    if v == "bf16":
        return WeightFormat(source="override bf16")
    if isinstance(v, str) and v.startswith("fp8-") and v in OVERRIDE_CHOICES:
        gran, ue8m0 = v[4:].removesuffix("-ue8m0"), v.endswith("-ue8m0")
        return _fp8(gran, f"override {v}", ue8m0=ue8m0)
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    raise ValueError(f"unknown weight format {shown}; choose one of {', '.join(OVERRIDE_CHOICES)}")


def _show(v, width: int = 40) -> str:
    text = repr(v)
    return text if len(text) <= width else text[:width - 3] + "..."


# ---------------------------------------------------------------- which q/k/v modules a list of names covers

_PROJS = ("q_proj", "k_proj", "v_proj")
_PREFIXES = ("model.layers.{}.self_attn.", "model.language_model.layers.{}.self_attn.",
             "language_model.model.layers.{}.self_attn.")
PROBE_LAYERS = 128  # layers checked where the config does not say how many there are
_DIGITS = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def _covered(entries, layers: range) -> dict[int, set]:
    """prefix index -> the (projection, layer) pairs that `entries` (module names or patterns) cover."""
    out: dict[int, set] = {i: set() for i in range(len(_PREFIXES))}
    for e in entries:
        if not isinstance(e, str) or not e:
            continue
        for i, pre in enumerate(_PREFIXES):
            for p in _PROJS:
                if e.startswith("re:") or any(c in e for c in "*?["):
                    out[i] |= {(p, n) for n in layers if _matches(e, pre.format(n) + p)}
                    continue
                num = _DIGITS.search(e)  # a plain name names one layer, or none (then every layer alike)
                n = int(num.group(1)) if num else layers.start
                if f".{e}." not in f".{pre.format(n)}{p}.":
                    continue
                out[i] |= {(p, n)} if num and n in layers else set() if num else {(p, m) for m in layers}
    return out


def _matches(entry: str, name: str) -> bool:
    if entry.startswith("re:"):
        try:
            return re.match(entry[3:], name) is not None
        except re.error:
            return False
    return fnmatch.fnmatchcase(name, entry)


def _coverage(covered: dict[int, set], layers: range, used) -> str:
    """"all" (every layer's q, k and v), "none", or "some" (some of them, or namings that disagree), under the
    namings `used`: those some list matched (a list names the model's own modules), all where none matched."""
    full = len(_PROJS) * len(layers)
    states = {"all" if len(c) == full else "none" if not c else "some" for i, c in covered.items() if i in used}
    return states.pop() if len(states) == 1 else "some"


def _used(*covers: dict[int, set]) -> set[int]:
    return {i for c in covers for i, pairs in c.items() if pairs} or set(range(len(_PREFIXES)))


def _layers(num_layers) -> range:
    return range(num_layers if isinstance(num_layers, int) and num_layers > 0 else PROBE_LAYERS)


def _mixed(source: str, key: str, what: str) -> UnsupportedWeightFormat:
    return UnsupportedWeightFormat(source, key, f"{what}: a front that mixes bf16 and fp8 layers is not served; "
                                                "supported: every layer's q, k and v projections fp8, or all bf16 "
                                                "(override: bf16)")


def _skip_list(qc: dict, source: str, keys) -> tuple[str | None, list]:
    """The first of `keys` that `qc` sets, and its list (validated)."""
    for k in keys:
        v = qc.get(k)
        if v is None:
            continue
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise UnsupportedWeightFormat(source, f"quantization_config.{k}", f"must be a list of module names, got "
                                                                              f"{_show(v)}")
        return k, v
    return None, []


def _bf16_note(key: str, entries) -> WeightFormat:
    shown = ", ".join(map(str, entries[:3])) + (", ..." if len(entries) > 3 else "")
    return WeightFormat(source="bf16", note=f"quantization_config.{key} keeps the attention's q/k/v projections in "
                                            f"bf16 ({shown})")


# ---------------------------------------------------------------- quantization_config


def parse_quantization_config(qc: dict | None, source: str, *, num_layers: int | None = None) -> WeightFormat:
    """The WeightFormat a config.json's `quantization_config` announces for the attention front (BF16 when there is
    none); UnsupportedWeightFormat (key "quantization_config.<key>") for anything else. `num_layers` (the config's
    num_hidden_layers) lets lists of per-layer module names be read as covering every layer or not; without it
    PROBE_LAYERS layers are checked."""
    if qc is None:
        return BF16
    if not isinstance(qc, dict):
        raise UnsupportedWeightFormat(source, "quantization_config", f"must be a JSON object, got {_show(qc)}")
    method = qc.get("quant_method")
    layers = _layers(num_layers)
    if method in ("fp8", "fbgemm_fp8"):
        key, skip = _skip_list(qc, source, ("modules_to_not_convert", "ignored_layers"))
        skipped = _covered(skip, layers)
        cov = _coverage(skipped, layers, _used(skipped))
        if cov == "all":
            return _bf16_note(key, skip)
        if cov == "some":
            first = next(e for e in skip if any(_covered([e], layers).values()))
            raise _mixed(source, f"quantization_config.{key}", f"keeps some of the attention's q/k/v projections "
                                                                f"in bf16 ({_show(first)}) and quantizes the others")
        return _fp8_method(qc, source) if method == "fp8" else _fp8("channel", "fbgemm_fp8 (per-channel)")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source, layers)
    shown = _show(method) if method is not None else "missing"
    raise UnsupportedWeightFormat(source, "quantization_config.quant_method", f"{shown} is not read; {SUPPORTED}")


def _fp8_method(qc: dict, source: str) -> WeightFormat:
    fmt = qc.get("fmt")
    if fmt is not None and fmt not in ("e4m3", "float8_e4m3fn"):  # MiniMax-M2 spells it as torch's dtype
        raise UnsupportedWeightFormat(source, "quantization_config.fmt", f"{_show(fmt)}: only e4m3 weights are "
                                                                         f"served; {SUPPORTED}")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "float", "ue8m0"):
        raise UnsupportedWeightFormat(source, "quantization_config.scale_fmt",
                                      f"{_show(scale_fmt)}: scale_fmt is \"float\" or \"ue8m0\"")
    bs = qc.get("weight_block_size")
    if bs is None:
        if scale_fmt == "ue8m0":
            raise UnsupportedWeightFormat(source, "quantization_config.scale_fmt", "ue8m0 scales come with "
                                                                                   "weight_block_size [128, 128]")
        return _fp8("tensor", "fp8 (per-tensor)")
    if not isinstance(bs, (list, tuple)) or list(bs) != list(BLOCK):
        raise UnsupportedWeightFormat(source, "quantization_config.weight_block_size",
                                      f"{_show(bs)}: only [128, 128] blocks are served; {SUPPORTED}")
    ue8m0 = scale_fmt == "ue8m0"
    return _fp8("block", "fp8 (block 128x128" + (", ue8m0)" if ue8m0 else ")"), ue8m0=ue8m0)


_CT_FORMATS = ("float-quantized", "naive-quantized")
_CT_PRESET = {"block": "FP8_BLOCK", "channel": "FP8_DYNAMIC", "tensor": "FP8"}


def _compressed_tensors(qc: dict, source: str, layers: range) -> WeightFormat:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UnsupportedWeightFormat(source, "quantization_config.config_groups",
                                      f"must be a non-empty object of groups, got {_show(groups)}")
    ig_key, ignore = _skip_list(qc, source, ("ignore",))
    ignored = _covered(ignore, layers)
    everything = {(p, n) for p in _PROJS for n in layers}
    named, covers = [ignored], []  # what the lists match (the model's naming); each group's (key, group, cover)
    for name, g in groups.items():
        key = f"quantization_config.config_groups.{name}"
        if not isinstance(g, dict):
            raise UnsupportedWeightFormat(source, key, f"must be a JSON object, got {_show(g)}")
        targets = g.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise UnsupportedWeightFormat(source, f"{key}.targets", f"must be a list of names, got {_show(targets)}")
        cov = _covered([t for t in targets if t != "Linear"], layers)  # "Linear": every linear layer (its class)
        named.append(cov)
        covers.append((key, g, {i: (everything if "Linear" in targets else c) - ignored[i] for i, c in cov.items()}))
    used = _used(*named)
    found = [(key, _ct_weights(g, key, qc, source), cov) for key, g, cov in covers  # groups quantizing the attention
             if any(cov[i] for i in used)]
    if not found:
        why = f"{ig_key} / targets" if ig_key else "targets"
        return WeightFormat(source="bf16", note=f"no compressed-tensors group quantizes the attention's q/k/v "
                                                f"projections (quantization_config {why})")
    grans = {gran for _, gran, _ in found}
    if len(grans) > 1:
        (k0, g0, _), (k1, g1, _) = found[0], next(f for f in found if f[1] != found[0][1])
        raise UnsupportedWeightFormat(source, k1, f"quantizes the attention's weights {g1}-wise but {k0} {g0}-wise: "
                                                  f"the fused q|k|v|gate takes one format; {SUPPORTED}")
    union = {i: set().union(*(c[i] for _, _, c in found)) for i in range(len(_PREFIXES))}
    if _coverage(union, layers, used) != "all":
        raise _mixed(source, "quantization_config." + ("ignore" if ig_key else "config_groups"),
                     "quantizes some of the attention's q/k/v projections and keeps the others in bf16")
    gran = grans.pop()
    return _fp8(gran, f"compressed-tensors {_CT_PRESET[gran]}", scale_dtype="bfloat16")


def _ct_weights(g: dict, key: str, qc: dict, source: str) -> str:
    """The granularity of a compressed-tensors group's weights; UnsupportedWeightFormat unless e4m3 as served."""
    fmt = g.get("format", qc.get("format"))
    if fmt is not None and fmt not in _CT_FORMATS:
        where = f"{key}.format" if "format" in g else "quantization_config.format"
        raise UnsupportedWeightFormat(source, where, f"{_show(fmt)} is not read; {SUPPORTED}")
    w = g.get("weights")
    if not isinstance(w, dict):
        raise UnsupportedWeightFormat(source, f"{key}.weights", f"no float8 weights ({_show(w)}); {SUPPORTED}")
    bits, typ = w.get("num_bits", 8), str(w.get("type", "int")).lower()  # compressed-tensors' defaults
    if bits != 8 or typ != "float":
        raise UnsupportedWeightFormat(source, f"{key}.weights", f"num_bits {_show(bits)} type {_show(typ)} is not "
                                                                f"read; {SUPPORTED}")
    if w.get("symmetric", True) is not True:
        raise UnsupportedWeightFormat(source, f"{key}.weights.symmetric", "asymmetric (zero-point) weights are not "
                                                                          f"served; {SUPPORTED}")
    if w.get("dynamic", False) not in (False, None):
        raise UnsupportedWeightFormat(source, f"{key}.weights.dynamic", "weights quantized at run time are not a "
                                                                        f"stored format; {SUPPORTED}")
    strategy = w.get("strategy")
    if strategy is None:  # compressed-tensors infers it from group_size
        strategy = {None: "tensor", -1: "channel"}.get(w.get("group_size"), "group")
    strategy = str(strategy).lower()
    if strategy not in _CT_PRESET:
        raise UnsupportedWeightFormat(source, f"{key}.weights.strategy", f"{_show(strategy)} is not read; "
                                                                         f"{SUPPORTED}")
    if strategy == "block":
        bs = w.get("block_structure")
        if isinstance(bs, str):  # older compressed-tensors: "128x128"
            bs = [int(x) if x.strip().isdigit() else x for x in bs.lower().split("x")]
        if not isinstance(bs, (list, tuple)) or list(bs) != list(BLOCK):
            raise UnsupportedWeightFormat(source, f"{key}.weights.block_structure",
                                          f"{_show(w.get('block_structure'))}: only [128, 128] blocks are served; "
                                          f"{SUPPORTED}")
    return strategy
