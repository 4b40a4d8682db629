"""The roofline-style plot: achieved weight bandwidth per N and M for each mode against the copy line."""
from __future__ import annotations

import os
import sys

SERIES = (("chain", "o-"), ("after-norm", "s-"), ("isolated", "^-"), ("cublas", "x--"), ("unfused", "d:"))


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed: no plot written", file=sys.stderr)
        return None
    return plt


def _save(plt, fig, out_dir: str, name: str) -> str:
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    p = os.path.join(out_dir, name)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def write_plot(doc: dict, out_dir: str, name: str = "qkv_front_roofline.png") -> str | None:
    """One panel per N (x: M, y: TB/s of weight bytes); None, with a warning, when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None
    rows = [r for r in doc["rows"] if r.get("tbps") is not None]
    ns = sorted({r["N"] for r in rows})
    if not ns:
        return None
    fig, axes = plt.subplots(1, len(ns), figsize=(4.2 * len(ns), 3.8), squeeze=False, sharey=True)
    copy = doc.get("copy_TBps")
    for ax, n in zip(axes[0], ns, strict=True):
        tp = next(r["tp"] for r in rows if r["N"] == n)
        for mode, style in SERIES:
            pts = sorted((r["M"], r["tbps"]) for r in rows if r["N"] == n and r["mode"] == mode)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=mode, ms=4)
        if copy:
            ax.axhline(copy, color="k", lw=1, ls="--", label=f"copy {copy:.2f} TB/s")
        ax.set_title(f"TP{tp}  N={n}")
        ax.set_xlabel("M (tokens)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("weight bytes / time (TB/s)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"qkv_front on {doc.get('device')} (after-norm: front's added time)", fontsize=10)
    return _save(plt, fig, out_dir, name)


ALL_M_SERIES = (("musekern", "o-", "musekern (planner's path)"), ("cublas", "x--", "cuBLAS GEMM alone"),
                ("gemm_epilogue", "s:", "cuBLAS + fused epilogue"), ("unfused", "d:", "cuBLAS + torch epilogue"),
                ("compiled", "v:", "cuBLAS + torch.compile epilogue"))


def plot_us_against_m(rows: list, series, title: str, out_dir: str, name: str) -> str | None:
    """One panel per N of `rows` ({"N", "tp", "M", "us": {key: us}}): us per layer against M (log-log), one line per
    (key, style, label) of `series` (points without that key left out)."""
    plt = _pyplot() if rows else None
    if plt is None:
        return None
    ns = sorted({r["N"] for r in rows})
    fig, axes = plt.subplots(1, len(ns), figsize=(4.4 * len(ns), 3.8), squeeze=False)
    for ax, n in zip(axes[0], ns, strict=True):
        tp = next(r["tp"] for r in rows if r["N"] == n)
        for key, style, label in series:
            pts = sorted((r["M"], r["us"][key]) for r in rows if r["N"] == n and r["us"].get(key))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, ms=4)
        ax.set_title(f"TP{tp}  N={n}")
        ax.set_xlabel("M (tokens)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("us per layer")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    return _save(plt, fig, out_dir, name)


def write_all_m_plot(doc: dict, out_dir: str, name: str = "qkv_front_all_m.png") -> str | None:
    """One panel per N of the all-M table: us per layer against M (log-log), every path side by side."""
    return plot_us_against_m(doc.get("all_m") or [], ALL_M_SERIES, f"the attention front at every M on "
                             f"{doc.get('device')}", out_dir, name)
