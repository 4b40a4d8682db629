#!/usr/bin/env python3
"""Summarise an Nsight Compute source page (SASS, CSV) by where the warps stall.

  ncu --kernel-name regex:qkv_front --launch-skip 3 --launch-count 1 --section WarpStateStats \\
      --section SourceCounters --page source --print-source sass --csv python3 bench/ncu_qkv_front.py N M > S.csv
  python3 bench/ncu_hotspots.py S.csv [TOP]

Prints the stall samples per opcode (HMMA, LDSM, SYNCS, BAR, ...) and the TOP instructions with the most
samples, each with its address and SASS text: which part of the kernel (main loop, exchange, epilogue) the
warps wait in.
"""
import csv
import io
import sys
from collections import Counter


def rows_of(path: str) -> list[dict]:
    text = open(path, errors="replace").read()
    start = text.find('"Address"')  # ncu prints banner lines before the CSV header
    if start < 0:
        raise SystemExit(f"{path}: no SASS source table (\"Address\" column) found")
    return list(csv.DictReader(io.StringIO(text[start:])))


def main(argv) -> int:
    rows = rows_of(argv[0])
    top = int(argv[1]) if len(argv) > 1 else 25
    cols = list(rows[0])
    sample_col = next(c for c in cols if "Sampling" in c and "All" in c) if any(
        "Sampling" in c and "All" in c for c in cols) else next(c for c in cols if "Sampling" in c)
    src_col = next(c for c in cols if c.strip().lower() == "source")

    def samples(r):
        try:
            return int(float((r.get(sample_col) or "0").replace(",", "")))
        except ValueError:
            return 0

    total = sum(samples(r) for r in rows) or 1
    by_op = Counter()
    for r in rows:
        op = (r.get(src_col) or "").split()
        op = [t for t in op if not t.startswith("@")]
        by_op[op[0].split(".")[0] if op else "?"] += samples(r)
    print(f"{sample_col}: {total} samples over {len(rows)} instructions")
    for op, n in by_op.most_common(15):
        print(f"  {op:12} {n:8d}  {100 * n / total:5.1f}%")
    print(f"top {top} instructions:")
    for r in sorted(rows, key=samples, reverse=True)[:top]:
        text = (r.get(src_col) or "")[:90]
        print(f"  {r.get('Address', '?'):>8} {samples(r):7d} {100 * samples(r) / total:5.1f}%  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
