"""The README's flows, run as written, so a documented flow cannot break silently.

- The top section: the `make prepare` transcript is the Makefile's commands and a real prepare's output on a
  neutral path (its first rows, then how many more, then the summary); `make readme` regenerates it (`python
  tests/test_readme_flows.py`).
- "Using it": the Python example takes variants of the bundled plan; every MUSEKERN_* variable is listed.
- "CI cache warming": every fenced block runs in bash, the `$K` blocks once per CI job (N = 2, each job a
  fresh machine: its own HOME and default cache dir; the working directory is the artifacts they share), the
  remote on a local nginx (skipped where nginx is missing).
- "Deploying in a container": the Dockerfile's steps run stage by stage against a folder per stage standing in
  for its root file system (COPY copies, RUN runs in bash with the container paths mapped there); the
  `pip install` steps are checked (they install this repository with extras it has), not run.

The config every flow uses is tests/data/multimodal_wrapper.json (a published-style config.json with no
musekern block: the README's `--tp 1,2,4,8` is what plans the bundled model's variants).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIG = ROOT / "tests" / "data" / "multimodal_wrapper.json"
HAVE_DSL = importlib.util.find_spec("cutlass") is not None
needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="needs the build extra (nvidia-cutlass-dsl)")
README_REMOTE = "http://cache.internal:8080/musekern"
NEUTRAL_HOME = "/home/user"
TIME = re.compile(r"^\d+\.\ds$")
ELIDED = re.compile(r"^\.\.\. (\d+) more rows ")
SHOWN_ROWS = 3  # the transcript shows the plan's first rows; `musekern plan` lists them all


def _planned() -> int:
    from musekern.config import load_config, with_tensor_parallel
    from musekern.plan import plan_model
    from musekern.targets import get_target

    return len(plan_model(with_tensor_parallel(load_config(CONFIG), (1, 2, 4, 8)), [get_target("h200")]))


PLANNED = _planned()  # what the README's `--model cfg.json --target h200 --tp 1,2,4,8` plans


# ---------------------------------------------------------------- reading the README
def section(title: str | None) -> str:
    """The text of `## title` up to the next `## ` heading (None: the text before the first one)."""
    text = README.read_text()
    if title is None:
        return text.split("\n## ", 1)[0]
    start = text.index(f"\n## {title}\n")
    nxt = text.find("\n## ", start + 1)
    return text[start:nxt if nxt >= 0 else len(text)]


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """[(language, body)] of the ``` blocks in `text`."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```\s*$", text, re.M | re.S)]


def prepare_transcript() -> list[str]:
    """The lines of the top section's `make prepare` transcript."""
    blocks = [b for _, b in fenced_blocks(section(None)) if "musekern prepare" in b]
    assert len(blocks) == 1, "the top section should show one `make prepare` transcript"
    return blocks[0].splitlines()


def split_transcript(lines: list[str]) -> tuple[list[str], str, list[str], int, str]:
    """(make's commands, prepare's header line, its table lines as shown, the rows left out, its summary line)."""
    i = next(i for i, ln in enumerate(lines) if ln.startswith("musekern prepare: "))
    m = ELIDED.match(lines[-2])
    assert m, f"the transcript's second-to-last line says how many rows it leaves out: {lines[-2]!r}"
    return lines[:i], lines[i], lines[i + 1:-2], int(m[1]), lines[-1]


def table_rows(lines: list[str]) -> list[list[str]]:
    """The data rows of a prepare table (header and rule dropped), as cells, the time column (machine-dependent)
    blanked. The rule gives the columns; a row wrapped onto more lines (cli/common.table fits 120 columns: a long
    label goes on under its column, the first cell blank) is joined back."""
    assert lines[0].startswith("target") and set(lines[1].replace(" ", "")) == {"-"}, lines[:2]
    spans = [m.span() for m in re.finditer(r"-+", lines[1])]
    rows: list[list[str]] = []
    for ln in lines[2:]:
        parts = [ln[a:b if i < len(spans) - 1 else None].strip() for i, (a, b) in enumerate(spans)]
        if rows and not parts[0]:
            rows[-1] = [x + y for x, y in zip(rows[-1], parts, strict=True)]
        else:
            rows.append(parts)
    return [["" if TIME.match(c) else c for c in r] for r in rows]


# ---------------------------------------------------------------- running commands as a user would
def venv_env(home: Path, **extra) -> dict:
    """A shell environment of a fresh machine with this venv's `musekern` on PATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MUSEKERN_") and k not in ("XDG_CACHE_HOME", "HOME")}
    home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", **extra)
    for v in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(v, None)  # the test remote is local
    env["no_proxy"] = "127.0.0.1,localhost"
    return env


def bash(script: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"README step failed (exit {r.returncode}):\n{script}\n--- stderr:\n{r.stderr[-3000:]}"
    return r


def default_cache_dir_of(home: Path) -> str:
    """Where `musekern` puts its cache for a user with this HOME and nothing set (platformdirs)."""
    r = subprocess.run([sys.executable, "-c", "from musekern.store.cache import default_cache_dir; "
                        "print(default_cache_dir())"], env=venv_env(home), capture_output=True, text=True,
                       check=True)
    return r.stdout.strip()


def make_prepare_commands() -> list[str]:
    """What `make prepare` runs on a fresh clone (`make -n -B`: every step, none run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", "--no-print-directory", "-n", "-B", "prepare"], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True).stdout.splitlines()


# ---------------------------------------------------------------- "On a fresh machine"
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_transcript_commands_are_the_makefiles():
    make_lines, *_ = split_transcript(prepare_transcript())
    assert make_lines == make_prepare_commands()


def test_readme_shows_no_machines_paths_and_no_test_counts():
    text = README.read_text()
    for local in ("/root/", "/tmp/", "/opt/wheels", "+cpu-cp3"):
        assert local not in text, local
    assert not re.search(r"\d+ passed", text)


def test_transcript_is_the_bundled_plan_on_a_neutral_path(tmp_path):
    from musekern.config import load_config
    from musekern.plan import plan_model
    from musekern.store.keys import dsl_version, key_parts
    from musekern.targets import get_target

    _, header, table, elided, summary = split_transcript(prepare_transcript())
    plan = plan_model(load_config(), [get_target("h200")])
    neutral = f"{NEUTRAL_HOME}/.cache/musekern"
    # the path a user called `user` gets (platformdirs, nothing set), spelled from a HOME of our own
    home = tmp_path / "home" / "user"
    assert default_cache_dir_of(home) == f"{home}/.cache/musekern"
    assert header == f"musekern prepare: {len(plan)} variant(s) for h200 -> {neutral}"
    assert summary == f"{len(plan)} built, 0 pulled, 0 cached, 0 failed -> {neutral}"
    rows = table_rows(table)
    assert len(rows) + elided == len(plan)
    shown = plan[:len(rows)]
    assert [(r[0], r[1], r[2], r[5]) for r in rows] == [("h200", "sm_90a", "built", e.variant.label) for e in shown]
    if dsl_version() is not None:  # keys are computed without compiling: source hash + DSL version
        assert [r[4] for r in rows] == [key_parts(e.variant, e.arch, dsl_version()).key()[:12] for e in shown], \
            "README's prepare keys are stale: run `make readme`"


def test_the_transcript_reads_the_same_wrapped_to_120_columns():
    """`make readme` after issue 28 writes prepare's table fitted to 120 columns (long labels wrapped): it reads as
    the same rows as the one-line-a-row transcript."""
    from musekern.cli.common import table

    _, _, lines, _, _ = split_transcript(prepare_transcript())
    rows = table_rows(lines)
    wrapped = table(rows, ["target", "arch", "status", "time", "key", "variant"], width=120).splitlines()
    assert max(map(len, wrapped)) <= 120 and len(wrapped) >= len(lines) and table_rows(wrapped) == rows


# ---------------------------------------------------------------- "Using it"
def test_python_example_uses_a_planned_variant():
    import ast

    from musekern.config import load_config
    from musekern.kernels.qk_norm.variant import qk_norm_variant
    from musekern.plan import plan_model
    from musekern.targets import get_target

    code = "\n".join(b for lang, b in fenced_blocks(section("Using it")) if lang == "python")
    calls = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") ==
             "qk_norm"]
    assert calls
    planned = {e.variant for e in plan_model(load_config(), [get_target("h200")])}
    for call in calls:
        kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        for vectors in (1, 1 << 20):  # a small and a large input take different builds: both must be planned
            v = qk_norm_variant("bfloat16", kw["head_dim"], float(kw.get("scale", 1.0)), vectors)
            assert v in planned, v.label


def test_every_variable_is_documented():
    from musekern import env

    text = section("Using it")
    for v in env.VARIABLES:
        assert f"`{v.name}`" in text, v.name


# ---------------------------------------------------------------- "CI cache warming"
def _ci_blocks(remote: bool) -> list[str]:
    blocks = [b for lang, b in fenced_blocks(section("CI cache warming")) if not lang]
    return [b for b in blocks if (README_REMOTE in b) == remote]


def _run_ci(blocks: list[str], work: Path, n: int = 2, subs: dict | None = None) -> list[list[str]]:
    """Run each block as written; a block with $K once per job. Returns each run's stdout, per block."""
    shutil.copy(CONFIG, work / "config.json")
    outs = []
    for i, block in enumerate(blocks):
        script = block
        for a, b in (subs or {}).items():
            script = script.replace(a, b)
        jobs = range(1, n + 1) if block.startswith("# each of N CI jobs") else [None]  # the block says so
        runs = []
        for k in jobs:
            env = venv_env(work.parent / f"machine-{i}-{k or 0}", N=str(n), **({"K": str(k)} if k else {}))
            runs.append(bash(script, work, env).stdout)
        outs.append(runs)
    return outs


@needs_dsl
@pytest.mark.slow
def test_ci_bundle_flow_runs_as_written(tmp_path):
    work = tmp_path / "ci"
    work.mkdir()
    blocks = _ci_blocks(remote=False)
    assert len(blocks) == 2 and any("export" in b and "--shard $K/$N" in b for b in blocks)
    _run_ci(blocks, work)  # the merge block ends with `musekern doctor`: exit 1 if anything is missing
    from musekern.store.cache import Cache

    assert len(Cache(work / "merged").entries()) == PLANNED
    # split between the shards, not doubled
    assert len(Cache(work / "shard1").entries()) + len(Cache(work / "shard2").entries()) == PLANNED


@needs_dsl
@pytest.mark.slow
def test_ci_remote_flow_runs_as_written(tmp_path, nginx_server):
    url, _ = nginx_server
    work = tmp_path / "ci"
    work.mkdir()
    blocks = _ci_blocks(remote=True)
    assert len(blocks) == 2
    (_, [later]) = _run_ci(blocks, work, subs={README_REMOTE: f"{url}/musekern"})
    jobs = [json.loads((work / f"prepare-{k}.json").read_text()) for k in (1, 2)]
    assert all(j["ok"] for j in jobs)
    assert sum(j["counts"]["built"] for j in jobs) == PLANNED  # each distinct build compiled once across the jobs
    assert f"0 built, {PLANNED} pulled, 0 cached, 0 failed" in later  # the later machine compiles nothing


# ---------------------------------------------------------------- "Deploying in a container"
def dockerfile() -> list[tuple[str, str]]:
    """[(instruction, arguments)] of the README's Dockerfile, continuation lines joined."""
    (text,) = [b for lang, b in fenced_blocks(section("Deploying in a container")) if lang == "dockerfile"]
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            instr, _, args = line.strip().partition(" ")
            out.append((instr.upper(), args.strip()))
    return out


def _check_pip_install(args: str, rootfs: Path) -> None:
    """`pip install X[extras]`: X must be this repository (copied into the stage) and the extras its own."""
    import importlib.metadata as md

    extras_known = set(md.metadata("musekern").get_all("Provides-Extra") or [])
    words = shlex.split(args)
    assert words[:2] == ["pip", "install"], args
    targets = [w for w in words[2:] if not w.startswith("-")]
    assert targets, args
    for t in targets:
        m = re.fullmatch(r"(/[^\[\]]+)(?:\[([\w,]+)\])?", t)
        assert m, f"{t!r}: install from the repository copied into the image (no package index has musekern)"
        src = rootfs / m.group(1).lstrip("/")
        assert (src / "pyproject.toml").exists() and (src / "pyproject.toml").resolve() == ROOT / "pyproject.toml", t
        assert set((m.group(2) or "").split(",")) - {""} <= extras_known, t


def _in_stage(rootfs: Path, text: str) -> str:
    """The text with every absolute container path moved under the stage's root folder."""
    return re.sub(r"(?<![\w.:/])(/[\w.-][\w./-]*)", lambda m: str(rootfs) + m.group(1), text)


@needs_dsl
@pytest.mark.slow
def test_container_builds_as_written(tmp_path):
    context = tmp_path / "context"  # the build context: this repository plus the user's config.json
    context.mkdir()
    shutil.copy(CONFIG, context / "config.json")
    stages: dict[str, Path] = {}
    rootfs, env, outputs = None, {}, []
    for instr, args in dockerfile():
        if instr == "FROM":
            name = args.split(" AS ")[-1].strip() if " AS " in args.upper() else f"stage{len(stages)}"
            rootfs = stages[name.lower()] = tmp_path / f"rootfs-{len(stages)}"
            rootfs.mkdir()
            env = {}
        elif instr == "COPY":
            words = args.split()
            src_root = context
            if words[0].startswith("--from="):
                src_root = stages[words[0].split("=", 1)[1].lower()]
                words = words[1:]
            src, dst = words
            dst_path = rootfs / dst.lstrip("/")
            dst_path.parent.mkdir(parents=True, exist_ok=True)
            s = ROOT if (src_root is context and src == ".") else src_root / src.lstrip("/")
            if s.resolve() == ROOT:
                dst_path.symlink_to(ROOT, target_is_directory=True)  # the repository itself, not a copy of it
            elif s.is_dir():
                shutil.copytree(s, dst_path, symlinks=True)
            else:
                shutil.copy(s, dst_path)
        elif instr == "ENV":
            k, _, v = args.partition("=")
            env[k.strip()] = _in_stage(rootfs, v.strip())
        elif instr == "RUN":
            if args.startswith("pip install"):
                _check_pip_install(args, rootfs)
            else:
                outputs.append(bash(_in_stage(rootfs, args), tmp_path, venv_env(tmp_path / "home", **env)).stdout)
        else:
            pytest.fail(f"the test does not know Dockerfile instruction {instr}")
    assert len(stages) == 2 and len(outputs) == 2  # prepare + verify in the build stage, doctor in the serving one
    assert f"{PLANNED} entries checked, 0 bad" in outputs[0] and "every planned variant is in the cache" in outputs[1]
    # The build stage's prepare printed the table the README's top section shows (same variants, same keys)
    lines = outputs[0].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.split()[:3] == ["target", "arch", "status"])
    end = next(i for i in range(start, len(lines)) if re.match(r"\d+ built, ", lines[i]))  # the summary line
    built = table_rows(lines[start:end])  # header, rule, one row a build (wrapped onto more lines or not)
    assert len(built) == PLANNED
    _, _, readme_table, _, _ = split_transcript(prepare_transcript())
    shown = table_rows(readme_table)
    assert built[:len(shown)] == shown, "README's prepare output is stale: run `make readme`"


# ---------------------------------------------------------------- make readme
def regenerate() -> None:
    """Rewrite the top section's transcript from `make -n -B prepare` and a real `musekern prepare` on a fresh
    HOME, its paths spelled for a user called `user`."""
    import tempfile

    make_lines = make_prepare_commands()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "user"
        r = subprocess.run([sys.executable, "-m", "musekern", "prepare"], cwd=ROOT, env=venv_env(home),
                           capture_output=True, text=True, timeout=900)
        if r.returncode:
            sys.exit(f"musekern prepare failed:\n{r.stderr[-3000:]}")
        real = f"{home}/.cache/musekern"
        header = r.stderr.splitlines()[0].replace(real, f"{NEUTRAL_HOME}/.cache/musekern")
        out = r.stdout.replace(real, f"{NEUTRAL_HOME}/.cache/musekern").rstrip("\n").splitlines()
    summary = out[-1]  # out: table header, rule, one row a build (a long label wrapped onto more lines), summary
    starts = [i for i, ln in enumerate(out[:-1]) if i >= 2 and ln[:1].strip()]  # the lines that begin a row
    shown = out[:starts[SHOWN_ROWS]] if len(starts) > SHOWN_ROWS else out[:-1]
    more = f"... {len(starts) - SHOWN_ROWS} more rows (`musekern plan` lists every variant)"
    block = "\n".join([*make_lines, header, *shown, more, summary])
    text = README.read_text()
    old = "\n".join(prepare_transcript()) if "musekern prepare: " in text else "README-PREPARE-BLOCK"
    README.write_text(text.replace(old, block, 1))
    print(f"README.md: `make prepare` transcript regenerated ({len(block.splitlines())} lines)")


if __name__ == "__main__":
    regenerate()
