"""`python3 -m bench.harness`: the issue-5 research benchmark (GPU only; the repository root on PYTHONPATH, as
bench/device_env.sh sets it). Table (or --json) on stdout, progress on stderr. `bash bench/gpu_bench.sh` runs it on
the GPU machine; the package's own `musekern bench` is the small user-facing timing (musekern/cli/bench_cmd.py)."""
from __future__ import annotations

import click

from musekern.cli.common import Failure, UsageFailure, emit_json, json_option, log

NO_GPU = ("the bench harness needs a CUDA GPU (none is visible to torch); run it on the GPU machine, e.g. "
          "`bash bench/gpu_bench.sh` with the cache carried (see bench/README.md)")


def _modes(value: str) -> tuple:
    from .report import FRONT_MODES

    modes = tuple(m.strip() for m in value.split(",") if m.strip())
    bad = [m for m in modes if m not in FRONT_MODES]
    if bad or not modes:
        raise UsageFailure(f"--modes: unknown mode(s) {bad or value!r}; choose from {','.join(FRONT_MODES)}")
    return modes


def gpu_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


@click.command("harness")
@click.option("--quick", is_flag=True, help="M 1 and 16 only, 3 samples (a smoke run of a minute or so).")
@json_option
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench/results", show_default=True,
              help="Where the JSON and the PNG go.")
@click.option("--modes", default="chain,after-norm,isolated", show_default=True,
              help="Comma-separated qkv_front modes.")
@click.option("--tp", "tps", type=int, multiple=True, help="TP size(s) of the model plan (repeatable; default all).")
@click.option("--m", "ms", type=click.IntRange(1, 16), multiple=True,
              help="Decode token count(s) M (repeatable; default 1 2 4 8 9 12 16).")
@click.option("--no-host", is_flag=True, help="Skip the host-cost and fresh-process measurements.")
@click.option("--no-qk-norm", is_flag=True, help="Skip the qk_norm measurements.")
@click.option("--no-all-m", is_flag=True, help="Skip the all-M table (M 1..16384: fused front vs GEMM + epilogue).")
def bench_cmd(quick, as_json, out_dir, modes, tps, ms, no_host, no_qk_norm, no_all_m):
    """Benchmark qkv_front (chain, after-norm, isolated) against copy bandwidth, cuBLAS and an unfused chain;
    qk_norm bandwidth; host cost per call. Writes qkv_front_bench.json and qkv_front_roofline.png to --out."""
    mode_list = _modes(modes)
    if not gpu_available():
        raise Failure(NO_GPU)
    from . import all_m, plot, report, runner

    cfg = runner.BenchConfig.make(quick=quick, tps=tps, ms=ms, modes=mode_list)
    cfg.host, cfg.qk_norm, cfg.all_m = not no_host, not no_qk_norm, not no_all_m
    doc = runner.run(cfg)
    path = report.write_json(doc, out_dir)
    pngs = [p for p in (plot.write_plot(doc, out_dir), plot.write_all_m_plot(doc, out_dir)) if p]
    log(f"wrote {path}" + "".join(f" and {p}" for p in pngs))
    if as_json:
        emit_json(doc)
    else:
        click.echo(report.format_table(doc))
        if doc.get("all_m"):
            click.echo(all_m.format_all_m(doc))


if __name__ == "__main__":  # bench/gpu_bench.sh: python3 -m bench.harness
    bench_cmd(prog_name="python3 -m bench.harness")
