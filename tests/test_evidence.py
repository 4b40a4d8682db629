"""The evidence the docs stand on, held to a size a reader can hold (CPU only, no GPU, no cutlass).

- bench/results/ keeps at most MAX_RESULTS files, each cited by README.md or bench/NOTES.md: a new experiment
  replaces a file (the old one stays in git and is cited as `bench/results/<file>@<commit>`) instead of adding one.
- A citation `bench/results/<file>` (`results/<file>` inside bench/, or a bare `h200-...` name) must be in the tree;
  `bench/results/<file>@<commit>` must be in that commit (`git show <commit>:bench/results/<file>`).
- bench/NOTES.md (one section per planner rule) stays under MAX_NOTES_LINES, the README under MAX_README_LINES;
  the measurement log left the tree (bench/HISTORY.md@43333d7).
- Numbers: the README's performance tables (bf16 on the H200, FP8 weights) are read back from the results files
  they cite.
"""
import fnmatch
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README, NOTES, BENCH_README = "README.md", "bench/NOTES.md", "bench/README.md"
DOCS = (README, NOTES, BENCH_README)
CODE = ("musekern/**/*.py", "bench/**/*.py", "bench/*.sh", "tests/**/*.py", "Makefile")
# The limits of issue 27: what a reader holds in one sitting.
MAX_RESULTS = 20
MAX_NOTES_LINES = 250
MAX_README_LINES = 220

# a bare name counts only with a GPU target's prefix (the results files' naming); a name after any other folder
# (e.g. the shared anchors) is not a bench/results citation
CITE = re.compile(r"(?<![\w/.@-])(?:(?P<dir>(?:bench/)?results/)|(?=(?:h100|h200|h20|b200)-))"
                  r"(?P<name>[\w.*{},-]+\.(?:json|png|txt|csv))(?:@(?P<commit>[0-9a-f]{7,40}))?")


def _code_files() -> list[str]:
    """The code that may cite results files (not this file: its examples of the pattern are not citations)."""
    files = {str(p.relative_to(ROOT)) for pat in CODE for p in ROOT.glob(pat) if p.is_file()}
    me = str(Path(__file__).resolve().relative_to(ROOT))
    return sorted(f for f in files if f != me and not f.startswith(".venv/"))


def _citations(rel_paths) -> list[tuple[str, str, str | None]]:
    """(source file, name or pattern, commit or None) for every citation in these files."""
    return [(rel, m["name"], m["commit"]) for rel in rel_paths
            for m in CITE.finditer((ROOT / rel).read_text(errors="replace"))]


def _expand(pattern: str) -> list[str]:
    """`a-{x,y}-*.json` -> the patterns fnmatch understands (braces expanded)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [p for alt in m[1].split(",") for p in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _in_tree() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.is_file() and not p.name.startswith("."))


def _matches(name: str, files: list[str]) -> list[str]:
    return [f for pat in _expand(name) for f in fnmatch.filter(files, pat)]


def _lines(rel: str) -> int:
    return len((ROOT / rel).read_text().splitlines())


# ---------------------------------------------------------------- the limits
def test_results_folder_is_small_and_every_file_is_cited_by_readme_or_notes():
    files = _in_tree()
    assert len(files) <= MAX_RESULTS, (f"bench/results/ holds {len(files)} files (at most {MAX_RESULTS}): let a new "
                                       "result replace the file it supersedes and cite the old one as <file>@<commit>")
    cited = {f for _, name, commit in _citations([README, NOTES]) if commit is None for f in _matches(name, files)}
    assert set(files) - cited == set(), "bench/results/ files README.md and bench/NOTES.md do not cite: delete them"


@pytest.mark.parametrize("doc,limit", [(NOTES, MAX_NOTES_LINES), (README, MAX_README_LINES)])
def test_docs_stay_short(doc, limit):
    assert _lines(doc) <= limit, f"{doc}: {_lines(doc)} lines, at most {limit} (measurement prose: a rule or nothing)"


def test_the_measurement_log_left_the_tree():
    assert not (ROOT / "bench" / "HISTORY.md").exists(), "git keeps it: cite bench/HISTORY.md@<commit>"


def test_notes_open_with_what_they_are_not_a_list_of_commits():
    opening = (ROOT / NOTES).read_text().split("\n## ", 1)[0].split("\n\n", 1)[1]
    commits = re.findall(r"(?<![\w/.-])[0-9a-f]{7}(?![\w-])", opening)
    assert len(commits) <= 1, f"NOTES' opening paragraph names commits {commits}: say what the file is instead"


# ---------------------------------------------------------------- citations resolve
@pytest.mark.parametrize("source", [*DOCS, "code"])
def test_cited_results_files_are_in_the_tree(source):
    files = _in_tree()
    cited = [c for c in _citations(_code_files() if source == "code" else [source]) if c[2] is None]
    if source == "code":  # code cites by path; a bare name there is a script naming the file it writes
        text = {f: (ROOT / f).read_text(errors="replace") for f in _code_files()}
        cited = [c for c in cited if re.search(rf"results/{re.escape(c[1])}", text[c[0]])]
    missing = sorted({f"{src}: {name}" for src, name, _ in cited if not _matches(name, files)})
    assert not missing, f"cited but not in bench/results/ (cite a removed file as <file>@<commit>): {missing}"


def test_history_citations_name_a_commit_that_has_the_file():
    """`bench/results/<file>@<commit>` must be readable with `git show <commit>:bench/results/<file>`."""
    git = shutil.which("git")
    if not git or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    shallow = subprocess.run([git, "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    if shallow.returncode or shallow.stdout.strip() != "false":
        pytest.skip("a shallow clone lacks the history these citations name")
    refs = sorted({f"{commit}:bench/results/{name}" for _, name, commit in _citations([*DOCS, *_code_files()])
                   if commit})
    refs.append("43333d7:bench/HISTORY.md")  # NOTES' one citation of the measurement log
    r = subprocess.run([git, "cat-file", "--batch-check"], cwd=ROOT, input="\n".join(refs) + "\n",
                       capture_output=True, text=True, check=True)
    missing = [line.split()[0] for line in r.stdout.splitlines() if line.endswith(" missing")]
    assert not missing, f"cited history that git does not have: {missing}"


def test_citation_pattern():
    """What counts as a citation: the three spellings and a history one; not a file of another folder."""
    text = ("`bench/results/h200-a.json`, `results/b.png`, h200-c-r{1,2}.json, `bench/results/h200-d.json@0123abc`, "
            "`../shared/anchors/h200-e.json`, `qkv_front_bench.json`")
    found = [(m["name"], m["commit"]) for m in CITE.finditer(text)]
    assert found == [("h200-a.json", None), ("b.png", None), ("h200-c-r{1,2}.json", None),
                     ("h200-d.json", "0123abc")]
    assert _expand("h200-c-r{1,2}-*.json") == ["h200-c-r1-*.json", "h200-c-r2-*.json"]


def test_notes_sections_the_code_names_exist():
    """A comment citing `NOTES "<section>"` must find that section heading (or the start of one) in bench/NOTES.md."""
    headings = set(re.findall(r"^## (.+)$", (ROOT / NOTES).read_text(), re.M))
    cited = {(f, m[1]) for f in _code_files() + [BENCH_README]
             for m in re.finditer(r"NOTES(?:\.md)?`?,? \"([^\"\n]+)\"", (ROOT / f).read_text(errors="replace"))}
    assert cited, "expected the planner's comments to cite NOTES sections"
    missing = sorted(f"{f}: {name}" for f, name in cited if not any(h.startswith(name) for h in headings))
    assert not missing, f"cited NOTES sections that do not exist: {missing}"


def test_bench_readme_names_every_script_and_only_scripts_that_exist():
    readme = (ROOT / BENCH_README).read_text()
    bench = ROOT / "bench"
    scripts = sorted(str(p.relative_to(bench)) for pat in ("*.py", "*.sh", "probes/*.py") for p in bench.glob(pat))
    assert scripts
    unnamed = [s for s in scripts if not re.search(rf"(?<![\w/]){re.escape(s)}\b", readme)]
    assert not unnamed, f"bench/README.md does not name: {unnamed}"
    named = set(re.findall(r"(?<![\w/.])((?:[\w-]+/)*[\w-]+\.(?:py|sh))\b", readme))
    gone = sorted(n for n in named if not (bench / n).exists() and not (ROOT / n).exists())
    assert not gone, f"bench/README.md names scripts that do not exist: {gone}"


# ---------------------------------------------------------------- numbers in force, read back
def _readme_perf_rows(table: int = 0, cites: str = "h200-bench.json") -> list[tuple[int, list[str]]]:
    """The rows (M, cells) of the `table`-th table of the README's Performance section, whose text before it cites
    `cites`."""
    text = (ROOT / README).read_text()
    section = text[text.index("\n## Performance\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = section.split("\n\n")
    tables = [(lead, block) for lead, block in zip(blocks, blocks[1:], strict=False) if block.startswith("| M |")]
    lead, body = tables[table]
    assert f"`bench/results/{cites}`" in lead
    rows = re.finditer(r"^\| (\d+) \|(.*)\|$", body, re.M)
    return [(int(m[1]), [c.strip() for c in m[2].split("|")]) for m in rows]


def _shown(value: float, cell: str) -> bool:
    """`cell` is `value` as printed: rounded to the digits the cell shows."""
    digits = len(cell.split(".")[1]) if "." in cell else 0
    return f"{value:.{digits}f}" == cell


def test_readme_performance_table_is_the_results_file():
    """Each cell `musekern path / torch.mm / unfused` of the README's table is the all-M row of h200-bench.json."""
    bench = json.loads((RESULTS / "h200-bench.json").read_text())
    all_m = {(r["tp"], r["M"]): r for r in bench["all_m"]}
    rows = _readme_perf_rows()
    assert len(rows) >= 4
    for m, cells in rows:
        assert len(cells) == 3, cells
        for tp, cell in zip((8, 4, 1), cells, strict=True):
            r = all_m[(tp, m)]
            mk, path, mm, unfused = re.fullmatch(r"(\S+) (front|GEMM) / (\S+) / (\S+)", cell).groups()
            assert path == ("front" if r["path"] == "front" else "GEMM"), (tp, m, cell)
            for value, shown in ((r["us"]["musekern"], mk), (r["us"]["cublas"], mm), (r["us"]["unfused"], unfused)):
                assert _shown(value, shown), f"TP{tp} M = {m}: README shows {shown}, the results file has {value:.3f}"


def test_readme_fp8_weight_table_is_the_results_file():
    """Each cell `e4m3 channel / block / bf16 / _scaled_mm alone` of the README's FP8-weight table is the H100 w8_bench
    file's chain time (the fronts' M) or GEMM-path time (above), its path the rule's (kernels/qkv_front/rules.py)."""
    from musekern.config import load_config
    from musekern.kernels.qkv_front.rules import front_serves
    from musekern.targets import get_target

    bench = json.loads((RESULTS / "h100-w8-bench.json").read_text())
    front = {(r["tp"], r["M"]): r["us"] for r in bench["timing"]}
    gemm = {(r["tp"], r["M"]): r["us"] for r in bench["gemm"]}
    model, h100 = load_config(), get_target("h100")
    rows = _readme_perf_rows(1, "h100-w8-bench.json")
    assert len(rows) >= 3
    for m, cells in rows:
        for tp, cell in zip((8, 1), cells, strict=True):
            n = model.shard(tp).n
            shown = re.fullmatch(r"(\S+) (front|GEMM) / (\S+) (front|GEMM) / (\S+) (front|GEMM) / (\S+)", cell).groups()
            fp8_path = "front" if front_serves(n, m, h100, "fp8_e4m3") else "GEMM"
            bf16_path = "front" if front_serves(n, m, h100) else "GEMM"
            assert shown[1::2] == (fp8_path, fp8_path, bf16_path), (tp, m, cell)
            if fp8_path == "front":
                us = front[(tp, m)]
                values = (us["chain_fp8_channel"], us["chain_fp8_block"], us["chain_bf16"], us["chain_scaled_mm"])
            else:
                us = gemm[(tp, m)]
                values = (us["fp8_channel"], us["fp8_block"], us["bf16"], us["scaled_mm"])
            for value, text in zip(values, shown[0::2], strict=True):
                assert _shown(value, text), f"TP{tp} M = {m}: README shows {text}, the results file has {value:.3f}"
