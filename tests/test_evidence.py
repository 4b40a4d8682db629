"""The evidence the docs stand on (CPU only, no GPU, no cutlass).

A results file is cited as `bench/results/<file>` (`results/<file>` inside bench/, or by its bare `h200-...` name)
and must then be in the tree; `bench/results/<file>@<commit>` cites history and must be in that commit instead.
Every file in bench/results/ is cited by a doc or the code (the history file does not count: it records what is
no longer stood on), so the folder cannot grow without a reason. bench/README.md names every script of bench/.
"""
import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = ("README.md", "bench/NOTES.md", "bench/README.md")
HISTORY = "bench/HISTORY.md"
CODE = ("musekern/**/*.py", "bench/**/*.py", "bench/*.sh", "tests/**/*.py", "Makefile")
# Helper "front" rewrites this file's comments to cite bench/NOTES.md sections instead of results files; until that
# lands it still names files that left the tree. The strict xfail below fails once the file is clean: then drop it.

# a bare name counts only with a GPU target's prefix (the results files' naming); a name after any other folder
# (e.g. the shared anchors) is not a bench/results citation
CITE = re.compile(r"(?<![\w/.@-])(?:(?P<dir>(?:bench/)?results/)|(?=(?:h100|h200|h20|b200)-))"
                  r"(?P<name>[\w.*{},-]+\.(?:json|png|txt|csv))(?:@(?P<commit>[0-9a-f]{7,40}))?")


def _code_files(exclude=()) -> list[str]:
    """The code that may cite results files (not this file: its examples of the pattern are not citations)."""
    files = {str(p.relative_to(ROOT)) for pat in CODE for p in ROOT.glob(pat) if p.is_file()}
    skip = {*exclude, str(Path(__file__).resolve().relative_to(ROOT))}
    return sorted(f for f in files if f not in skip and not f.startswith(".venv/"))


def _citations(rel_paths) -> list[tuple[str, str, str | None]]:
    """(source file, name or pattern, commit or None) for every citation in these files."""
    out = []
    for rel in rel_paths:
        for m in CITE.finditer((ROOT / rel).read_text(errors="replace")):
            out.append((rel, m["name"], m["commit"]))
    return out


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


SOURCES = {"README.md": ["README.md"], "bench/NOTES.md": ["bench/NOTES.md"], "bench/README.md": ["bench/README.md"],
           "bench/HISTORY.md": [HISTORY], "code": _code_files()}


@pytest.mark.parametrize("source", [*SOURCES])
def test_cited_results_files_are_in_the_tree(source):
    files = _in_tree()
    cited = [c for c in _citations(SOURCES.get(source, [source])) if c[2] is None]
    missing = sorted({f"{src}: {name}" for src, name, _ in cited if not _matches(name, files)})
    assert not missing, f"cited but not in bench/results/ (cite a removed file as <file>@<commit>): {missing}"


def test_every_results_file_is_cited_by_a_doc_or_the_code():
    files = _in_tree()
    cited = {f for _, name, commit in _citations([*DOCS, *_code_files()]) if commit is None
             for f in _matches(name, files)}
    assert set(files) - cited == set(), "bench/results/ files no doc or code cites: delete them or cite them"


def test_history_citations_name_a_commit_that_has_the_file():
    """`bench/results/<file>@<commit>` must be readable with `git show <commit>:bench/results/<file>`."""
    git = shutil.which("git")
    if not git or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    shallow = subprocess.run([git, "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    if shallow.returncode or shallow.stdout.strip() != "false":
        pytest.skip("a shallow clone lacks the history these citations name")
    refs = sorted({f"{commit}:bench/results/{name}" for _, name, commit in
                   _citations([*DOCS, HISTORY, *_code_files()]) if commit})
    assert refs, "expected history citations in the docs"
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


def test_bench_readme_names_every_script_and_only_scripts_that_exist():
    readme = (ROOT / "bench" / "README.md").read_text()
    bench = ROOT / "bench"
    scripts = sorted(str(p.relative_to(bench)) for pat in ("*.py", "*.sh", "probes/*.py") for p in bench.glob(pat))
    assert scripts
    unnamed = [s for s in scripts if not re.search(rf"(?<![\w/]){re.escape(s)}\b", readme)]
    assert not unnamed, f"bench/README.md does not name: {unnamed}"
    named = set(re.findall(r"(?<![\w/.])((?:[\w-]+/)*[\w-]+\.(?:py|sh))\b", readme))
    gone = sorted(n for n in named if not (bench / n).exists() and not (ROOT / n).exists())
    assert not gone, f"bench/README.md names scripts that do not exist: {gone}"
