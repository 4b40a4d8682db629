"""The qkv_front builds bench/w8_bench.py launches: for each shard (N, KV heads) of the bundled model's TP 1, 2, 4, 8,
the planned h200 builds of M = 1..32 with bf16 weights and with e4m3 ones (channel and block scales) where the front
serves them. Prints labels (`musekern prepare --variant` takes them)."""
from __future__ import annotations

from musekern.targets import get_target

SHARDS = ((2176, 1), (4352, 2), (8704, 4), (17408, 8))  # TP8, TP4, TP2, TP1
WEIGHTS = (("bf16", "none"), ("fp8_e4m3", "channel"), ("fp8_e4m3", "block"))


def builds(target: str = "h200") -> dict:
    """{(n, weight_dtype, weight_scale, m): variant} for M = 1..32 where the front serves it (e4m3: 16, TP8 32)."""
    from musekern.kernels.qkv_front.rules import served_tokens

    t = get_target(target)
    out = {}
    for n, nkv in SHARDS:
        for wd, ws in WEIGHTS:
            for v, ms in served_tokens(n, nkv, t, 32, "bf16", wd, ws).items():
                for m in ms:
                    out[(n, wd, ws, m)] = v
    return out


if __name__ == "__main__":
    for lbl in sorted({v.label for v in builds().values()}):
        print(lbl)
