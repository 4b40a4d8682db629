#!/usr/bin/env python3
"""Turn a GPU round's junit XML into the results JSON we commit (commit, device, versions, every test),
and print a short table. Usage: python3 bench/gpu_results.py round.junit.xml out.json"""
from __future__ import annotations

import collections
import glob
import importlib.metadata
import json
import os
import sys
import xml.etree.ElementTree as ET


def versions() -> dict:
    out = {}
    for dist in ("torch", "cuda-bindings", "cuda-python", "nvidia-cutlass-dsl"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def device() -> dict:
    try:
        import torch

        p = torch.cuda.get_device_properties(0)
        from cuda.bindings import driver as drv

        drv.cuInit(0)
        return {"name": p.name, "sm_count": p.multi_processor_count, "capability": f"{p.major}.{p.minor}",
                "driver": drv.cuDriverGetVersion()[1]}
    except Exception as e:  # no GPU: still write what we have
        return {"name": None, "error": str(e)}


def main(xml_path: str, out_path: str) -> int:
    cache = os.environ.get("MUSEKERN_CACHE_DIR", ".musekern-cache")
    try:
        build = json.load(open(os.path.join(cache, "BUILD_INFO.json")))
    except OSError:
        build = {"commit": None}
    tests = []
    if os.path.exists(xml_path):
        for tc in ET.parse(xml_path).getroot().iter("testcase"):
            outcome = "passed"
            msg = None
            for tag in ("failure", "error", "skipped"):
                el = tc.find(tag)
                if el is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    msg = (el.get("message") or "")[:500]
            props = {p.get("name"): p.get("value") for p in tc.iter("property")}
            tests.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "outcome": outcome,
                          "seconds": float(tc.get("time") or 0), "properties": props, "message": msg})
    sanitizer = {}  # sanitizer-<tool>[-<script>].log beside the output: one record each
    out_dir = os.path.dirname(os.path.abspath(out_path))
    for log in sorted(glob.glob(os.path.join(out_dir, "sanitizer-*.log"))):
        lines = open(log, errors="replace").read().splitlines()
        sanitizer[os.path.basename(log)[len("sanitizer-"):-len(".log")]] = {
            "summary": [ln for ln in lines if "SUMMARY" in ln][-1:],
            "ran": [ln for ln in lines if ln.startswith("sanitize:")][-1:]}
    doc = {"commit": build.get("commit"), "sanitizer": sanitizer, "cache_built_dirty": build.get("dirty"),
           "device": device(),
           "versions": versions(), "cutlass_importable": importlib.util.find_spec("cutlass") is not None,
           "summary": dict(collections.Counter(t["outcome"] for t in tests)), "tests": tests}
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
    by_file = collections.defaultdict(collections.Counter)
    for t in tests:
        by_file[t["test"].split("::")[0]][t["outcome"]] += 1
    print(f"\nGPU round: {doc['device'].get('name')} commit {str(doc['commit'])[:12]} -> {out_path}")
    print(f"{'test module':48} {'passed':>7} {'failed':>7} {'error':>6} {'skipped':>8}")
    for mod, c in sorted(by_file.items()):
        print(f"{mod:48} {c['passed']:7} {c['failed']:7} {c['error']:6} {c['skipped']:8}")
    for tool, r in sanitizer.items():
        summary, ran = " ".join(r["summary"]) or "no summary", " ".join(r["ran"]) or "did not finish"
        print(f"sanitizer {tool:22} {summary} | {ran}")
    return 0


if __name__ == "__main__":
    import importlib.util

    sys.exit(main(*sys.argv[1:3]))
