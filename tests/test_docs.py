"""The docs against what backs them.

- Every published table and prose number is the rendering of its numbers/*.json
  (tools/publish.py), and every such file was measured on a clean checkout of a commit in
  this repository's history that has the scripts which made it.
- No measured-looking number sits in the docs' prose outside those markers.
- Every Python block of the README and docs/ runs (whole programs from recipes/ under torchrun),
  and the README example trains float8 like bf16.
- Every repository path the docs name exists, and nothing points outside the repository.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import publish  # noqa: E402

NUMBER_FILES = sorted((REPO / "numbers").glob("*.json"))


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


needs_git = pytest.mark.skipif(
    git("rev-parse", "HEAD").returncode != 0, reason="not a git checkout: commits cannot be checked"
)


# ---------------------------------------------------------------------------- published numbers


@pytest.mark.parametrize("doc", publish.DOCS)
def test_published_numbers_are_their_json_rendered(doc):
    text = (REPO / doc).read_text()
    assert publish.render(text) == text, f"{doc} is stale: run python tools/publish.py"


def test_every_table_and_number_file_is_published():
    tables, inline = set(), set()
    for doc in publish.DOCS:
        t, n = publish.used((REPO / doc).read_text())
        tables |= t
        inline |= n
    assert tables == set(publish.TABLES), "renderers without a block, or blocks without one"
    assert inline == set(publish.INLINE)
    # each JSON under numbers/ backs something: no orphan measurement
    missing = set()
    for fn in [*publish.TABLES.values(), *publish.INLINE.values()]:
        try:
            fn()
        except FileNotFoundError as e:
            # a suite timing's first measurement runs this test before its own file exists
            assert Path(e.filename).name in ("suite.json", "suite_avx2.json"), e
            missing.add(Path(e.filename).stem)
    assert {p.stem for p in NUMBER_FILES} == publish.LOADED - missing


def test_demo_on_a_busy_machine_learns_the_same():
    # The thread count is the only thing a loaded machine could change, and it is pinned:
    # the busy run must reproduce the idle run's losses exactly.
    idle, busy = (
        json.loads((REPO / "numbers" / f"{n}.json").read_text()) for n in ("demo", "demo_busy")
    )
    assert busy["data"]["busy_processes"] == 2 and busy["threads"] == idle["threads"]
    assert busy["data"]["hp_dtype"] == idle["data"]["hp_dtype"]
    for run, s in idle["data"]["runs"].items():  # every mode, every seed
        got = busy["data"]["runs"][run]
        assert (got["train_loss"], got["val_loss"]) == (s["train_loss"], s["val_loss"]), run


@needs_git
@pytest.mark.parametrize("path", NUMBER_FILES, ids=[p.name for p in NUMBER_FILES])
def test_number_file_names_a_clean_commit_that_has_its_scripts(path):
    d = json.loads(path.read_text())
    for key in ("command", "script", "git_commit", "git_dirty", "device", "torch", "date"):
        assert key in d, f"{path.name}: no {key!r}"
    assert d["git_dirty"] is False, f"{path.name} was measured on uncommitted changes"
    commit = d["git_commit"]
    assert git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0, (
        f"{path.name}: commit {commit} is not in this branch's history"
    )
    for script in [d["script"], *d.get("sources", [])]:
        assert git("cat-file", "-e", f"{commit}:{script}").returncode == 0, (
            f"{path.name}: commit {commit[:7]} has no {script}"
        )
    assert d["command"].startswith(f"python {d['script']}")
    # and they have not changed since: the numbers are what HEAD's scripts print
    changed = git(
        "diff", "--name-only", commit, "HEAD", "--", d["script"], *d.get("sources", [])
    ).stdout.split()
    assert changed == [], f"{path.name}: {changed} changed since {commit[:7]}: make numbers"


# ---------------------------------------------------------------------------- stray numbers

# A measurement in prose: a number with a unit or a multiplier (x, dB, %, ms, us, s, GB/s,
# TFLOP/s, min), a signed percentage, or an exponent. Versions (torch 2.13) and code
# (`1e-12` in backticks) are not caught.
MEASURED = re.compile(
    r"(?<![\w.])(\d+(\.\d+)?(x|e-?\d+| ?(dB|ms|us|s|%|GB/s|TFLOP/s))(?!\w)"
    r"|\d+(\.\d+)? ?(min|minutes|seconds)\b|[+-]\d+\.\d+%?)"
)


def prose(text: str) -> str:
    """``text`` without fenced code, inline code, and the generated blocks and numbers."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    text = publish.TABLE_RE.sub("", text)
    text = publish.INLINE_RE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


@pytest.mark.parametrize("doc", publish.DOCS)
def test_no_measured_number_outside_the_generated_blocks(doc):
    hits = [m.group(0) for m in MEASURED.finditer(prose((REPO / doc).read_text()))]
    assert hits == [], f"{doc}: numbers not rendered from numbers/*.json: {hits}"


def test_the_stray_number_check_can_fail():
    assert MEASURED.search(prose("a gap of 1.40% and 0.521x the bytes, 3 min"))
    assert not MEASURED.search(prose("torch 2.13.0 `0.5x` <!-- n:k -->1.5x<!-- /n -->"))


# ---------------------------------------------------------------------------- runnable snippets

# Every ```python block of the docs runs. A block that is a whole program from recipes/ (its
# docstring names the file) must be that file, byte for byte, and runs under torchrun on 2
# gloo processes; every other block runs in this process, as written.
RUNNABLE_FILE = re.compile(r"torchrun --nproc-per-node 2 (recipes/\w+\.py)")
CODE_DOCS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in REPO.glob("docs/*.md"))]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def run_block(block: str, where: str) -> dict:
    out = io.StringIO()
    scope: dict = {"__name__": "__main__"}
    with contextlib.redirect_stdout(out):
        exec(compile(block, where, "exec"), scope)  # noqa: S102
    scope["printed"] = out.getvalue()
    return scope


# A trainer that only `make setup` installs (torchtitan: --no-deps, Python >= 3.11): a block
# importing it runs where it is installed (`make test`), and is left out elsewhere (the
# `make test-torch` venvs).
SETUP_ONLY = ("torchtitan",)


def _needs_absent_package(block: str) -> bool:
    imported = set(re.findall(r"^\s*(?:from|import) (\w+)", block, flags=re.M))
    return any(p in imported and importlib.util.find_spec(p) is None for p in SETUP_ONLY)


def _gloo_teardown_abort(stderr: str) -> bool:
    """A rank aborted by gloo's thread teardown after destroy_process_group ("terminate
    called without an active exception", SIGABRT): a torch bug a loaded machine sometimes
    hits at exit (benchmarks/measures/gloo.py's workers skip the teardown). The program's
    work is judged by its printed losses, checked next."""
    return "terminate called without an active exception" in stderr and "exitcode: -6" in stderr


@pytest.mark.parametrize("doc", CODE_DOCS)
def test_python_blocks_run(doc):
    blocks = python_blocks((REPO / doc).read_text())
    for i, block in enumerate(blocks):
        if _needs_absent_package(block):
            continue
        program = (
            RUNNABLE_FILE.search(block.split("\n\n", 2)[1]) if block.startswith('"""') else None
        )
        if program is None:
            run_block(block, f"{doc} block {i}")
            continue
        path = program.group(1)
        assert (REPO / path).read_text() == block, f"{doc} shows another text than {path}"
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                path,
            ],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0 or _gloo_teardown_abort(r.stderr), r.stderr[-3000:]
        losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", r.stdout)]
        assert len(losses) == 5 and losses[-1] < losses[0], r.stdout  # it trains


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced block of ``text`` as ``(info string, body)``."""
    blocks, info, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if info is None:
                info, body = line[3:].strip(), []
            else:
                blocks.append((info, "\n".join(body)))
                info = None
        elif info is not None:
            body.append(line)
    return blocks


@pytest.mark.parametrize("doc", CODE_DOCS)
def test_python_code_sits_in_python_blocks(doc):
    # only ```python blocks run (test_python_blocks_run): Python elsewhere is an untested fragment
    fragments = [
        body
        for info, body in fenced_blocks((REPO / doc).read_text())
        if info != "python" and re.search(r"^(from|import) \w", body, flags=re.M)
    ]
    assert fragments == [], f"{doc}: Python outside a ```python block: {fragments}"


def test_readme_is_a_front_page():
    """The README stays a front page (install, the two commands, an example, the recipes,
    where to go further, limitations in short): the details live in docs/."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail to docs/"


@pytest.mark.parametrize("forced", [None, "float32"])
def test_readme_example_trains_float8_like_hp(forced, monkeypatch):
    """The README example as written: on this CPU's hp dtype, and forced to fp32 (what a CPU
    without native bf16 runs); float8 tracks hp in both."""
    if forced:
        monkeypatch.setenv("FLOAT8KIT_CPU_HP_DTYPE", forced)
    else:
        monkeypatch.delenv("FLOAT8KIT_CPU_HP_DTYPE", raising=False)
    import torch

    from float8kit import Float8Linear
    from float8kit.versions import cpu_hp_dtype

    blocks = python_blocks((REPO / "README.md").read_text())
    threads = torch.get_num_threads()
    try:
        scope = run_block(blocks[0], "README.md example")
        # one thread, as train.py: "seconds" on a busy 2-core machine too (not a minute)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert scope["hp_dtype"] == cpu_hp_dtype() and scope["hp"][0].weight.dtype == cpu_hp_dtype()
    kinds = [n for n, m in scope["fp8"].named_modules() if isinstance(m, Float8Linear)]
    assert kinds == ["0", "2"]  # the 256/1024 layers; the 16-class head ("4") stays hp
    name = str(cpu_hp_dtype()).removeprefix("torch.")
    rows = re.findall(rf"step (\d+): {name} ([\d.]+)  float8 ([\d.]+)", scope["printed"])
    assert [int(r[0]) for r in rows] == [10, 20, 30, 40, 50, 60]
    hp, fp8 = ([float(r[k]) for r in rows] for k in (1, 2))
    assert fp8[-1] < 0.6 * fp8[0] and hp[-1] < 0.6 * hp[0]  # both learn, stably
    for a, b in zip(hp, fp8, strict=True):
        assert abs(b - a) <= 0.05 * a + 0.02, (hp, fp8)  # float8 tracks hp


# ---------------------------------------------------------------------------- references

DOC_FILES = [
    "README.md",
    *sorted(str(p.relative_to(REPO)) for p in REPO.glob("docs/*.md")),
    "benchmarks/README.md",
    "benchmarks/NOTES.md",
    "recipes/README.md",
]
REPO_PATH = re.compile(
    r"\b((?:float8kit|tests|recipes|benchmarks|docs|tools|numbers)/[\w./-]+"
    r"\.(?:py|md|json|png))\b"
)


@pytest.mark.parametrize("doc", DOC_FILES)
def test_paths_the_docs_name_exist(doc):
    text = (REPO / doc).read_text()
    missing = set()
    for path in REPO_PATH.findall(text):
        if not (REPO / path).exists() and not (REPO / doc).parent.joinpath(path).exists():
            missing.add(path)
    for link in re.findall(r"\]\(([^)#\s]+)", text):
        if "://" in link:
            continue
        target = REPO / link.lstrip("/") if link.startswith("/") else (REPO / doc).parent / link
        if not target.exists():
            missing.add(link)
    assert not missing, f"{doc} names files this repository does not have: {sorted(missing)}"


def heading_anchors(text: str) -> Iterator[str]:
    """The anchors GitHub gives ``text``'s headings (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    for title in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.DOTALL), re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        yield slug if n == 0 else f"{slug}-{n}"


@pytest.mark.parametrize("doc", DOC_FILES)
def test_links_reach_a_heading_and_not_their_own_file(doc):
    text = (REPO / doc).read_text()
    bad = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
        if "://" in target:
            continue
        if not target:
            path = REPO / doc
        elif target.startswith("/"):
            path = REPO / target.lstrip("/")
        else:
            path = (REPO / doc).parent / target
        if target and path.resolve() == (REPO / doc).resolve():
            bad.append(f"{target}#{anchor}: links to itself (use #{anchor or 'heading'})")
        elif anchor and path.suffix == ".md" and path.exists():
            if anchor not in set(heading_anchors(path.read_text())):
                bad.append(f"{target}#{anchor}: no such heading")
    assert bad == [], f"{doc}: {bad}"


UNFOLLOWABLE = re.compile(
    "|".join(
        [
            r"\bissue \d+",
            r"\bseed 0\d\d\b",
            "/" + "work/",
            "shared/" + "GPU.md",
            "DESIGN" + r"\.md",
        ]
    ),
    re.IGNORECASE,
)


def test_no_references_a_reader_cannot_follow():
    files = git("ls-files").stdout.split() or [str(p.relative_to(REPO)) for p in REPO.rglob("*")]
    hits = []
    for name in files:
        path = REPO / name
        if path.suffix not in {".md", ".py", ".toml", ""} or not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if UNFOLLOWABLE.search(line):
                hits.append(f"{name}:{i}: {line.strip()}")
    assert hits == []


def test_the_link_check_can_fail():
    assert list(heading_anchors("# Title\n\n## Measured (CPU)\n## Measured (CPU)\n")) == [
        "title",
        "measured-cpu",
        "measured-cpu-1",
    ]


def test_install_tells_cpu_users_how_to_get_the_cpu_torch():
    """`pip install -e .` alone resolves torch to the multi-GB CUDA build; the README's install
    block must show the CPU wheel index before it."""
    install = (REPO / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    cpu = install.find("--index-url https://download.pytorch.org/whl/cpu")
    assert 0 <= cpu < install.find("pip install -e .")
