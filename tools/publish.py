"""Render the docs' measured tables from numbers/*.json (written by tools/measure.py).

    python tools/publish.py            # rewrite every block in the docs from the JSON
    python tools/publish.py --check    # exit 1 if any block differs from its rendering

A published table lives between two markers, and a number in prose inside an inline pair:

    <!-- table:NAME -->
    (rendered: a caption naming command, device, commit, date, then the table)
    <!-- /table -->
    ... measured <!-- n:KEY -->0.52x<!-- /n --> the bytes ...

NAME is a key of TABLES, KEY of INLINE. Everything between the markers is generated: edit
the renderer here, never the rendered text. tests/test_docs.py runs ``check`` on every file
in DOCS.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NUMBERS = REPO / "numbers"
sys.path.insert(0, str(REPO / "recipes"))
DOCS = [
    "README.md",
    "docs/api.md",
    "docs/numerics.md",
    "docs/scaling.md",
    "docs/fsdp.md",
    "docs/gpu.md",
    "docs/tp.md",
    "docs/moe.md",
    "docs/memory.md",
    "docs/monitor.md",
    "docs/optim.md",
    "docs/performance.md",
    "docs/torchao.md",
    "docs/limitations.md",
    "docs/numbers.md",
    "benchmarks/README.md",
    "benchmarks/NOTES.md",
    "recipes/README.md",
]

TABLE_RE = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.DOTALL)
INLINE_RE = re.compile(r"(<!-- n:([\w.-]+) -->)(.*?)(<!-- /n -->)")


LOADED: set[str] = set()  # the numbers/ files the renderers have read


@functools.cache
def load(name: str) -> dict:
    LOADED.add(name)
    return json.loads((NUMBERS / f"{name}.json").read_text())


def caption(name: str) -> str:
    """Where a table's numbers come from: command, device, versions, commit, date, load."""
    d = load(name)
    load_avg = d.get("load_avg_1m_5m_15m")
    return (
        f"`{d['command']}`: {d['device']}; torch {d['torch']}, torchao {d['torchao']}; "
        f"commit {d['git_commit'][:7]}; {d['date'][:10]}; load average at start "
        f"{load_avg[0] if load_avg else '?'}; [numbers/{name}.json](/numbers/{name}.json)"
    )


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def gap(x: float, ref: float) -> str:
    return f"{100 * (x - ref) / ref:+.2f}%"


def sci(x: float) -> str:
    """1.3e-3, not Python's 1.3e-03."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def rel(x: float) -> str:
    """A max relative loss difference: 0 is said in words."""
    return "**bitwise equal** losses" if x == 0 else f"max rel. diff {sci(x)}"


# ---------------------------------------------------------------------------- GPU runs

# A GPU run is committed under benchmarks/results/ (docs/gpu.md) and cannot be re-measured
# on the CPU machine: its tables name the commit it ran at.
GPU_RUN = REPO / "benchmarks" / "results" / "2026-11-26-nvidia-h200"


@functools.cache
def gpu_result(rel: str) -> dict:
    return json.loads((GPU_RUN / rel).read_text())


# Runs whose JSON names the device copy's stale HEAD (its git metadata was the session's
# first commit, 07a013f, "dirty"): the tree that actually ran, per file (casts/README.md).
GPU_TREE = {
    "casts/traffic.json": "f6ebb87",
    "casts/linear.json": "f6ebb87",
    "casts/cast.json": "f6ebb87's kernel with 64x64 tiles (before the tile choice)",
}


def gpu_caption(rel: str) -> str:
    d = gpu_result(rel)
    path = (GPU_RUN / rel).relative_to(REPO)
    tree = GPU_TREE.get(rel)
    commit = f"commit {d['git_commit'][:7]}" if tree is None else f"float8kit {tree}"
    return (
        f"`{d['command']}`: {d['device']}; torch {d['torch']}, torchao {d['torchao']}; "
        f"{commit}; {d['date'][:10]}; [{path}](/{path})"
    )


def gpu_linear_table(rel: str) -> str:
    d = gpu_result(rel)
    rows = [
        [
            f"{r['M']}x{r['K']}x{r['N']}",
            r["recipe"],
            f(r["bf16_ms"], ".3f"),
            f(r["float8kit_ms"], ".3f"),
            f(r.get("torchao_ms"), ".3f"),
            f"{r['float8kit_speedup']:.2f}x",
            "-" if r.get("torchao_speedup") is None else f"{r['torchao_speedup']:.2f}x",
            f(r["float8kit_sqnr_db"]),
        ]
        for r in d["rows"]
        if r["mode"] == "fwd_bwd"
    ]
    how = "compiled" if d["rows"][0]["compiled"] else "eager"
    return f"{gpu_caption(rel)}; one Linear, fwd+bwd, {how}, median of {d['iters']} calls\n\n" + (
        table(
            [
                "M x K x N",
                "recipe",
                "bf16 ms",
                "float8kit ms",
                "torchao ms",
                "float8kit vs bf16",
                "torchao vs bf16",
                "float8kit SQNR dB",
            ],
            rows,
        )
    )


def gpu_train_table() -> str:
    d = gpu_result("acceptance/train.json")
    rows = [
        [
            r["variant"],
            f(r["step_ms"], ".1f"),
            f(r["tokens_per_s"], ".0f"),
            f"{r['speedup_vs_bf16']:.2f}x",
            f(r["peak_mem_gib"]),
            f(r["loss_first"], ".4f"),
        ]
        for r in d["rows"]
    ]
    return (
        f"{gpu_caption('acceptance/train.json')}; preset {d['preset']}, {d['batch']}x{d['seq']} "
        f"tokens per step, compiled, median of {d['steps']} steps after {d['warmup']} warm-up\n\n"
        + table(["variant", "step ms", "tokens/s", "vs bf16", "peak GiB", "loss step 1"], rows)
    )


def gpu_compile_table() -> str:
    d = gpu_result("compile_precision.json")
    rows = [
        [
            r["recipe"],
            "yes" if r["bias"] else "no",
            "yes" if r["emulate_precision_casts"] else "no",
            *(
                ("bitwise" if r[k] is None else f(r[k]))
                for k in ("out_sqnr_db", "grad_input_sqnr_db", "grad_weight_sqnr_db")
            ),
        ]
        for r in d["rows"]
    ]
    return f"{gpu_caption('compile_precision.json')}; SQNR of compiled against eager\n\n" + table(
        ["recipe", "bias", "emulate_precision_casts", "output", "grad_input", "grad_weight"], rows
    )


# ---------------------------------------------------------------------------- GPU acceptance


@dataclasses.dataclass(frozen=True)
class AccRun:
    """One acceptance run (benchmarks/gpu_acceptance.sh): its folder under
    benchmarks/results/, the commit whose tree ran (its README says why the JSON may name
    another or say dirty) and its training-step files, each timing its own bf16."""

    folder: str
    tree: str
    train: tuple[str, ...]

    def path(self, rel: str) -> Path:
        return REPO / "benchmarks" / "results" / self.folder / rel


# 2026-11-27: both parts, then two training-step calls; the JSON names the device copy's
# stale HEAD (222957e, "dirty": the copy kept the session's first git metadata).
ACC_FIRST = AccRun("2026-11-27-nvidia-h200", "9744355", ("train_ao.json", "train.json"))
# 2026-11-29: part 1 and the training step, then the rest of part 2; "dirty" is the
# untracked .whl/ folder of wheels alone (acceptance/git_status.txt). Its folder also holds
# the cast-op probe of that lease.
ACC_PREVIOUS = AccRun("2026-11-29-nvidia-h200", "952f326", ("train.json", "train_rowwise.json"))
# 2026-11-30: part 1, then part 2 (acceptance/calls_times.txt); the JSON names the device
# copy's git metadata (8c3c792, "dirty": the session's first HEAD) while the tree was
# c02bc34's (acceptance/git_status.txt lists the files it changed).
ACC = AccRun("2026-11-30-nvidia-h200", "c02bc34", ("train.json", "train_rowwise.json"))
SEED_SHAPE = (4096, 8192, 16384)

# The GPU acceptance targets, checked against the run (the thresholds of the acceptance run)
TARGET_SEED_SPEEDUP = 1.55
TARGET_DELAYED_OVER_DYNAMIC = 1.05
TARGET_TRAIN = {"tensorwise": 1.30, "delayed": 1.40}


@functools.cache
def gpu_acc(rel: str, run: AccRun = ACC) -> dict:
    return json.loads(run.path(rel).read_text())


def gpu_acc_caption(rel: str, run: AccRun = ACC, tree: str | None = None) -> str:
    d = gpu_acc(rel, run)
    path = run.path(rel).relative_to(REPO)
    return (
        f"`{d['command']}`: {d['device']}; torch {d['torch']}, torchao {d['torchao']}; "
        f"float8kit {tree or run.tree}; {d['date'][:10]}; [{path}](/{path})"
    )


# 2026-11-30's third call (optim/): the low-bit optimizers after the CUDA division fix, on
# the tree of this commit's library and benchmarks (its JSON names the device copy's HEAD)
ACC_OPTIM_TREE = "efee979"


def _acc_linear_rows(run: AccRun) -> list[dict]:
    return [
        r
        for rel in ("acceptance/linear_compiled.json", "acceptance/linear_more.json")
        for r in gpu_acc(rel, run)["rows"]
    ]


def _acc_row(run: AccRun, recipe: str, shape: tuple[int, int, int]) -> dict:
    (r,) = [
        r
        for r in _acc_linear_rows(run)
        if r["recipe"] == recipe and (r["M"], r["K"], r["N"]) == shape
    ]
    return r


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def gpu_acc_linear_table(run: AccRun = ACC) -> str:
    rows = [
        [
            f"{r['M']}x{r['K']}x{r['N']}",
            r["recipe"],
            f(r["bf16_ms"], ".3f"),
            _x(r.get("float8kit_speedup")),
            _x(r.get("torchao_speedup")),
            f(r["bf16_synced_ms"], ".3f"),
            _x(r.get("float8kit_synced_speedup")),
            _x(r.get("torchao_synced_speedup")),
            f(r["float8kit_sqnr_db"]),
        ]
        for r in _acc_linear_rows(run)
    ]
    d = gpu_acc("acceptance/linear_compiled.json", run)
    return (
        f"{gpu_acc_caption('acceptance/linear_compiled.json', run)} (rowwise_with_gw_hp and "
        f"blockwise: acceptance/linear_more.json, the same flags at the seed shape); one "
        f"Linear, fwd+bwd, compiled, median of {d['iters']} calls; back to back (the host "
        "queues ahead) and synchronized after every call\n\n"
        + table(
            [
                "M x K x N",
                "recipe",
                "bf16 ms",
                "float8kit vs bf16",
                "torchao vs bf16",
                "bf16 ms synced",
                "float8kit vs bf16 synced",
                "torchao vs bf16 synced",
                "float8kit SQNR dB",
            ],
            rows,
        )
    )


def _acc_train_rows(run: AccRun) -> list[tuple[str, dict]]:
    return [(rel, r) for rel in run.train for r in gpu_acc(rel, run)["rows"]]


def gpu_acc_train_table(run: AccRun = ACC) -> str:
    rows = [
        [
            rel.removesuffix(".json"),
            r["variant"],
            f(r.get("step_ms"), ".1f"),
            f(r.get("tokens_per_s"), ".0f"),
            _x(r.get("speedup_vs_bf16")),
            f(r.get("peak_mem_gib")),
            f(r.get("loss_first"), ".4f"),
        ]
        for rel, r in _acc_train_rows(run)
        if "step_ms" in r
    ]
    d = gpu_acc(run.train[0], run)
    captions = "; and ".join(gpu_acc_caption(rel, run) for rel in run.train)
    return (
        f"{captions}; preset {d['preset']}, {d['batch']}x{d['seq']} tokens per step, "
        f"compiled, median of {d['steps']} steps after {d['warmup']} warm-up; each call "
        "times its own bf16\n\n"
        + table(
            ["call", "variant", "step ms", "tokens/s", "vs bf16", "peak GiB", "loss step 1"],
            rows,
        )
    )


def gpu_acc_roofline_table(run: AccRun = ACC) -> str:
    d = gpu_acc("acceptance/roofline.json", run)
    rows = [
        [
            f"{r['M']}x{r['K']}x{r['N']}",
            f(r["bf16_pred_ms"], ".3f"),
            f(r["fp8_pred_ms"], ".3f"),
            _x(r["predicted_speedup"]),
            _x(r["measured_float8kit_speedup"]),
            f"{r['measured_float8kit_speedup'] / r['predicted_speedup']:.2f}",
            _x(r["measured_torchao_speedup"]),
        ]
        for r in d["rows"]
    ]
    rates = d["rates"]
    return (
        f"{gpu_acc_caption('acceptance/roofline.json', run)}; rates measured on the card: "
        f"bf16 {rates['bf16_tflops']:.0f} TFLOP/s, float8 {rates['fp8_tflops']:.0f} TFLOP/s, "
        f"{rates['bw_tbps']:.2f} TB/s; measured: tensorwise, compiled, back to back\n\n"
        + table(
            [
                "M x K x N",
                "bf16 ms (pred)",
                "float8 ms (pred)",
                "predicted",
                "float8kit measured",
                "measured / predicted",
                "torchao measured",
            ],
            rows,
        )
    )


def _acc_shapes(run: AccRun) -> list[tuple[int, int, int]]:
    rows = gpu_acc("acceptance/linear_compiled.json", run)["rows"]
    return list(dict.fromkeys((r["M"], r["K"], r["N"]) for r in rows))


def gpu_acc_targets_table(run: AccRun = ACC) -> str:
    """The GPU acceptance targets, each read from the run: what was needed, what was measured."""
    out = []

    def row(target: str, needed: str, got: list[tuple[str, float]], ok) -> None:
        shown = ", ".join(f"{k}: {v:.2f}x" if k else f"{v:.2f}x" for k, v in got)
        out.append([target, needed, shown, "yes" if all(ok(v) for _, v in got) else "**no**"])

    def name(shape) -> str:
        return "x".join(map(str, shape))

    def speedup_per_shape(x: str, slow: tuple[str, str], fast: tuple[str, str]):
        """(shape, slow's ms / fast's ms) per shape; ``slow``, ``fast``: (recipe, library)."""
        return [
            (
                name(s),
                _acc_row(run, slow[0], s)[f"{slow[1]}{x}_ms"]
                / _acc_row(run, fast[0], s)[f"{fast[1]}{x}_ms"],
            )
            for s in _acc_shapes(run)
        ]

    timings = (("", "back to back"), ("_synced", "synchronized"))
    for x, how in timings:
        got = speedup_per_shape(x, ("tensorwise", "torchao"), ("tensorwise", "float8kit"))
        row(f"tensorwise vs torchao, every shape, {how}", "1.00x or more", got, lambda v: v >= 1.0)
    for x, how in timings:
        got = [("", _acc_row(run, "tensorwise", SEED_SHAPE)[f"float8kit{x}_speedup"])]
        need = TARGET_SEED_SPEEDUP
        row(f"tensorwise vs bf16 at {name(SEED_SHAPE)}, {how}", f"{need:.2f}x or more", got,
            lambda v: v >= TARGET_SEED_SPEEDUP)  # fmt: skip
    for x, how in timings:
        got = speedup_per_shape(x, ("tensorwise", "float8kit"), ("delayed", "float8kit"))
        need = TARGET_DELAYED_OVER_DYNAMIC
        row(f"delayed vs dynamic (tensorwise), {how}", f"{need:.2f}x or more", got,
            lambda v: v >= TARGET_DELAYED_OVER_DYNAMIC)  # fmt: skip
    for recipe, need in TARGET_TRAIN.items():
        got = [
            (rel.removesuffix(".json"), r["speedup_vs_bf16"])
            for rel, r in _acc_train_rows(run)
            if r["variant"] == f"float8kit:{recipe}"
        ]
        row(f"llama3-8b-4l {recipe} vs bf16", f"{need:.2f}x or more", got, lambda v, n=need: v >= n)
    date = gpu_acc("acceptance/linear_compiled.json", run)["date"][:10]
    return (
        f"The acceptance targets, from the JSON of the run of {date} (float8kit {run.tree})\n\n"
        + table(["target", "needed", "measured", "holds"], out)
    )


def gpu_acc_precompute_table(run: AccRun = ACC) -> str:
    d = gpu_acc("acceptance/precompute.json", run)
    rows = [
        [
            r["layers"],
            r["recipe"],
            f(r["host_us"], ".0f"),
            f(r["host_us_per_layer"], ".0f"),
            r["aten_ops"],
            f(r["host_us_gpu_busy"], ".0f"),
            f(r["busy_gpu_ms"], ".1f"),
            "yes" if r["waits_for_gpu"] else "no",
        ]
        for r in d["rows"]
    ]
    return (
        f"{gpu_acc_caption('acceptance/precompute.json', run)}; layers of {d['dim']}x{d['dim']}, "
        f"{d['tokens']} tokens; host time of one `precompute_scales` call (median), idle and "
        "with a queue of GPU work ahead of it\n\n"
        + table(
            [
                "layers",
                "recipe",
                "host us",
                "host us per layer",
                "aten ops",
                "host us, GPU busy",
                "queued GPU ms",
                "waits for the GPU",
            ],
            rows,
        )
    )


def gpu_cast_op_probe_table() -> str:
    """The opaque weight cast on and off under compile, beside torchao (cast_op_probe/)."""
    rows = []
    for rel in ("cast_op_probe/probe_a.json", "cast_op_probe/probe_b.json"):
        d = gpu_acc(rel, ACC_PREVIOUS)
        for r in d["rows"]:
            rows.append(
                [f"{r['M']}x{r['K']}x{r['N']}"]
                + [_x(r[f"{v}_vs_ao_{t}"]) for t in ("b2b", "sync") for v in ("fk", "fk_noop")]
                + ["yes" if r["noop_bitwise"] else "**no**"]
            )
    path = ACC_PREVIOUS.path("cast_op_probe").relative_to(REPO)
    return (
        f"`probe.py` in [{path}](/{path}/README.md): {d['device']}, torch {d['torch']}; "
        "float8kit 8f85b28; compiled fwd+bwd of one Linear, tensorwise; torchao's time / "
        "float8kit's (above 1: faster than torchao), with the opaque weight cast as it was "
        "and with inductor casting the weight\n\n"
        + table(
            [
                "M x K x N",
                "op, back to back",
                "inductor, back to back",
                "op, synchronized",
                "inductor, synchronized",
                "same bits",
            ],
            rows,
        )
    )


def gpu_acc_optim_table(run: AccRun = ACC) -> str:
    """bench_optim on the card: the low-bit optimizers' step beside fp32 AdamW and torchao."""
    d = gpu_acc("optim/optim.json", run)
    rows = [
        [
            r["optimizer"],
            f(r["step_ms"], ".2f"),
            f(r["adamw_step_ms"], ".2f"),
            _x(r["over_adamw"]),
            f(r["bytes_per_param"], ".3f"),
            f(r["update_sqnr_db"]),
        ]
        for r in d["rows"]
    ]
    dim, hidden = d["dims"]
    return (
        f"{gpu_acc_caption('optim/optim.json', run, ACC_OPTIM_TREE)}; weights of a Llama "
        f"layer ({dim}x{dim} x 2, {hidden}x{dim}, {dim}x{hidden}), median step after 3 "
        f"warm-up of {d['steps']}\n\n"
        + table(
            [
                "optimizer",
                "step ms",
                "fp32 AdamW step ms",
                "over fp32 AdamW",
                "state bytes / param",
                f"update SQNR after {d['steps']} steps (dB)",
            ],
            rows,
        )
    )


def _acc_optim(optimizer: str) -> Callable[[], str]:
    """``optimizer``'s step time over fp32 AdamW's on the card."""

    def get() -> str:
        (r,) = [r for r in gpu_acc("optim/optim.json")["rows"] if r["optimizer"] == optimizer]
        return _x(r["over_adamw"])

    return get


def _acc_pytest(rel: str) -> Callable[[], str]:
    """The "N passed" (and any failures) of a committed pytest log's summary line (``rel``
    under the run's folder)."""

    def get() -> str:
        last = ACC.path(rel).read_text().strip().splitlines()[-1]
        counts = re.findall(r"(\d+ (?:passed|failed|error))", last)
        assert counts, f"{rel}: no pytest summary in {last!r}"
        return ", ".join(counts)

    return get


def _acc_speedup(recipe: str, lib: str, synced: bool = False) -> Callable[[], str]:
    x = "_synced" if synced else ""
    return lambda: _x(_acc_row(ACC, recipe, SEED_SHAPE)[f"{lib}{x}_speedup"])


def _acc_train(variant: str) -> Callable[[], str]:
    """``variant``'s speedup over the bf16 step timed in the same call."""

    def get() -> str:
        (r,) = [r for _, r in _acc_train_rows(ACC) if r["variant"] == variant]
        return _x(r["speedup_vs_bf16"])

    return get


def _gpu_train_speedup(variant: str) -> Callable[[], str]:
    def get() -> str:
        (r,) = [r for r in gpu_result("acceptance/train.json")["rows"] if r["variant"] == variant]
        return f"{r['speedup_vs_bf16']:.2f}x"

    return get


# ---------------------------------------------------------------------------- recipes


def compare_table(name: str) -> str:
    """recipes/compare.py's report table (compare.report_table: every mode over the same
    seeds, mean ± sd, the gap to hp against the seed noise, the verdict, the float8 layers),
    from the summary the run wrote, under a caption naming the run."""
    import compare  # recipes/compare.py: the report's own renderer (imports no torch)

    d = load(name)["data"]
    if "stats" not in d:
        raise KeyError(
            f"numbers/{name}.json predates compare.py's per-seed report: "
            f"re-measure it, python tools/measure.py {name}"
        )
    a = d["train_args"]
    env = "".join(f"{k}={v} " for k, v in d.get("env", {}).items())
    return (
        f"{caption(name)}; {env}hp dtype {d['hp_dtype']}; {a['preset']} preset, {a['steps']} "
        f"steps, batch {a['batch_size']} x {a['seq_len']} bytes, {d['n_params']:,} params, "
        f"seeds {', '.join(map(str, d['seeds']))} for every mode; data {d['data']['source']} "
        f"(sha256 {d['data']['sha256'][:16]}); wall time {load(name)['wall_s']:.0f} s\n\n"
        + compare.report_table(d)
    )


# ---------------------------------------------------------------------------- numerics


def numerics_table() -> str:
    rows = []
    for r in load("numerics")["data"]["rows"]:
        peer = (
            "bitwise equal"
            if r["bitwise_equal_to_torchao"]
            else f(r["float8kit_vs_torchao"], ".1f")
        )
        rows.append(
            [r["recipe"], r["gemm"], f(r["float8kit_vs_fp32"]), f(r["torchao_vs_fp32"]), peer]
        )
    return (
        caption("numerics")
        + "\n\n"
        + table(
            [
                "recipe",
                "gemm output",
                "float8kit vs fp32",
                "torchao vs fp32",
                "float8kit vs torchao",
            ],
            rows,
        )
    )


def experts_table() -> str:
    d = load("experts")["data"]
    s = d["shapes"]
    names = {
        "output": "output",
        "grad_input": "grad_input",
        "grad_w1": "grad_weight (first gemm)",
        "grad_w2": "grad_weight (second gemm)",
    }
    rows = [[names[k], f(v, ".1f")] for k, v in d["sqnr_db"].items()]
    return (
        f"{caption('experts')}; {s['tokens']} tokens, dim {s['dim']}, hidden {s['hidden']}, "
        f"4 experts, offs {s['offs']} (expert 1 gets no tokens: its weight grads are "
        f"{'exactly zero' if d['empty_expert_grad_exactly_zero'] else 'NOT zero'})\n\n"
        + table(["two grouped gemms, SiLU between", "float8 vs fp32 SQNR (dB)"], rows)
    )


def moe_hf_table() -> str:
    d = load("moe_hf")["data"]
    s = d["shapes"]
    rows = []
    for i, layer in enumerate(d["experts_sqnr_db"]):
        rows.append(
            [f"experts of layer {i}, expert-only (same inputs)"]
            + [f(layer[k], ".1f") for k in ("output", "grad_input")]
            + [f"{f(layer['grad_gate_up_proj'], '.1f')} / {f(layer['grad_down_proj'], '.1f')}"]
        )
    flips = ", ".join(f"{100 * x:.1f}%" for x in d["routing_flip_share"])
    rows.append(["whole model, logits", f(d["logits_sqnr_db"], ".1f"), "-", "-"])
    counts = d["float8_gemms_per_step"]
    losses = d["losses"]
    fp32, f8 = losses["fp32"], losses["float8_experts"]
    train = table(
        ["experts implementation", "float8 grouped gemms per step (forward + backward)"],
        [[f'`"{impl}"`', n] for impl, n in counts.items()],
    )
    return (
        f"{caption('moe_hf')}; {s['layers']} layers, {s['experts']} experts, top-"
        f"{s['top_k']}, gate_up_proj {tuple(s['gate_up_proj'])}, down_proj "
        f"{tuple(s['down_proj'])}; compared on {s['compared_tokens']} held-out tokens after "
        f"the fp32 training; tokens whose top-{s['top_k']} experts change, per layer: {flips}"
        "\n\n"
        + table(
            ["float8 vs fp32 SQNR (dB)", "output", "grad_input", "grad_weight (gate_up / down)"],
            rows,
        )
        + "\n\n"
        + train
        + "\n\n"
        + table(
            ["training, one batch", "loss at step 1", f"loss at step {s['train_steps']}", "gap"],
            [
                ["fp32", f(fp32[0], ".4f"), f(fp32[-1], ".4f"), "-"],
                ["float8 experts", f(f8[0], ".4f"), f(f8[-1], ".4f"), gap(f8[-1], fp32[-1])],
            ],
        )
    )


def scaling_table() -> str:
    s = load("scaling")["data"]
    rows = [
        ["DYNAMIC, input suddenly 100x larger", f(s["dynamic_spike"], ".1f")],
        [
            "DELAYED, the spike step (scale from the previous steps' amax)",
            f"**{s['delayed_spike_stale']:.1f}** (clipped)",
        ],
        [
            "DELAYED, the spike input again after one `precompute_scales`",
            f(s["delayed_spike_after_precompute"], ".1f"),
        ],
        ["STATIC `static_scale = 448/4`, inputs within ±4", f(s["static_inside"], ".1f")],
        ["STATIC, the same inputs 100x larger", f"**{s['static_100x']:.1f}** (clipped)"],
        [
            "STATIC after `calibrate` on 100x-300x inputs (two-layer MLP, both gemms float8)",
            f(s["static_calibrated"], ".1f"),
        ],
    ]
    return caption("scaling") + "\n\n" + table(["situation", "SQNR (dB)"], rows)


def not_measured(name: str) -> str | None:
    """What a table says before its numbers/NAME.json exists (a new measurement); None once
    it does."""
    if (NUMBERS / f"{name}.json").exists():
        return None
    return f"(not measured yet: python tools/measure.py {name})"


def nvfp4_numerics_table() -> str:
    """The nvfp4 recipe and its ablations against fp64, per case and gemm, one pass and
    grad_weight averaged; torchao's NVFP4 cast of both output-gemm operands beside."""
    if missing := not_measured("nvfp4_numerics"):
        return missing
    d = load("nvfp4_numerics")["data"]
    rows = [
        [
            r["case"],
            r["variant"],
            f(r["output"]),
            f(r["grad_input"]),
            f(r["grad_weight"]),
            f(r["grad_weight_averaged"]),
            f(r["torchao_cast_output"]),
        ]
        for r in d["rows"]
    ]
    header = ["case", "variant", "output", "grad_input", "grad_weight"]
    header += [f"grad_weight, mean of {d['averaged_passes']}", "output, torchao's casts"]
    return caption("nvfp4_numerics") + "\n\n" + table(header, rows)


def mx_numerics_table() -> str:
    """mxfp8 against fp32 beside torchao's emulated MXFP8, per case, rounding and gemm."""
    if missing := not_measured("mx_numerics"):
        return missing
    rows = []
    for r in load("mx_numerics")["data"]["rows"]:
        peer = (
            "bitwise equal"
            if r["bitwise_equal_to_torchao"]
            else f(r["float8kit_vs_torchao"], ".1f")
        )
        rows.append(
            [
                r["case"],
                r["rounding"].upper(),
                r["gemm"],
                f(r["float8kit_vs_fp32"]),
                f(r["torchao_vs_fp32"]),
                peer,
            ]
        )
    header = ["case", "scales", "gemm output", "float8kit vs fp32"]
    header += ["torchao MXFP8 vs fp32", "float8kit vs torchao"]
    return caption("mx_numerics") + "\n\n" + table(header, rows)


def fsdp_mx_table() -> str:
    """FSDP2 float8 all-gather of mxfp8 weights: bytes per pass vs bf16, the copy each
    pass gathered, bitwise checks."""
    if missing := not_measured("fsdp_mx"):
        return missing
    d = load("fsdp_mx")["data"]
    rows = []
    for world in (2, 3):
        r = d[f"ranks{world}"]
        for name, copies in (("forward", "forward_copies"), ("backward", "backward_copies")):
            p = r["passes"][name]
            rows.append(
                [
                    str(world),
                    name,
                    ", ".join(dict.fromkeys(r[copies])),
                    f"{p['fp8']:,}",
                    f"{p['bf16']:,}",
                    f"{p['ratio']:.3f}x",
                    "yes" if r["losses_bitwise_hp_all_gather"] else "NO",
                ]
            )
    header = ["ranks", "pass", "copy gathered", "MX bytes", "bf16 bytes", "ratio"]
    header += ["losses bitwise the hp all-gather"]
    return caption("fsdp_mx") + "\n\n" + table(header, rows)


def fsdp_nvfp4_table() -> str:
    """Bytes per pass of the NVFP4 all-gather against bf16's, 2 and 3 ranks."""
    if missing := not_measured("fsdp_nvfp4"):
        return missing
    d = load("fsdp_nvfp4")["data"]
    rows = []
    for world in (2, 3):
        r = d[f"ranks{world}"]
        for name in ("forward", "backward"):
            p = r["passes"][name]
            rows.append(
                [
                    world,
                    name,
                    f"{p['fp4']:,}",
                    f"{p['bf16']:,}",
                    f"{p['ratio']:.3f}x",
                    "yes" if r["weights_bitwise_one_device"] else "no",
                    "yes" if r["losses_bitwise_hp_all_gather"] else "no",
                ]
            )
    header = ["ranks", "pass", "NVFP4 bytes", "bf16 bytes", "ratio"]
    header += ["gathered weight bitwise one device", "losses bitwise the hp all-gather"]
    return caption("fsdp_nvfp4") + "\n\n" + table(header, rows)


EP_RUNS = {
    "rowwise/float8/bfloat16": "float8: rowwise e4m3 + e8m0 scale byte",
    "mxfp8/float8/bfloat16": "float8: MXFP8 (e4m3 + e8m0 per 32)",
    "rowwise_hp_wgrad/hp/bfloat16": "hp, float8 experts",
    "hp/hp/bfloat16": "hp, bf16 experts (the baseline)",
}


def _ep_ratio(world: int, run: str, phase: str | None) -> float:
    d = load("expert_parallel")["data"][f"ep{world}"]
    total = lambda r: sum(r[p] for p in load("expert_parallel")["data"]["phases"])
    if phase is None:
        return total(d[run]) / total(d["hp/hp/bfloat16"])
    return d[run][phase] / d["hp/hp/bfloat16"][phase]


def moe_tiny_ep_table() -> str:
    """train.py --ep 2 against the same 2-rank runs without expert parallelism, per mode: the
    val-loss means over the seeds, their gap against the seed noise, and the largest loss
    difference of one seed."""
    if missing := not_measured("moe_tiny_ep") or not_measured("moe_tiny_dp2"):
        return missing
    ep, dp = load("moe_tiny_ep")["data"], load("moe_tiny_dp2")["data"]
    n = len(ep["seeds"])
    rows = []
    for mode in ep["modes"]:
        a, b = ep["stats"][mode]["val_loss"], dp["stats"][mode]["val_loss"]
        gap = 100 * (a["mean"] - b["mean"]) / b["mean"]
        noise = 200 * math.sqrt(a["sd"] ** 2 / n + b["sd"] ** 2 / n) / b["mean"]
        diff = max(
            abs(ep["runs"][f"{mode}_seed{s}"][key] - dp["runs"][f"{mode}_seed{s}"][key])
            for s in ep["seeds"]
            for key in ("train_loss", "val_loss")
        )
        rows.append(
            [
                "none (bf16 experts, hp exchange)" if mode == "none" else mode,
                f"{a['mean']:.4f} ± {a['sd']:.4f}",
                f"{b['mean']:.4f} ± {b['sd']:.4f}",
                f"{gap:+.2f}% ± {noise:.2f}%",
                "within noise" if abs(gap) <= noise else ("worse" if gap > 0 else "better"),
                sci(diff),
            ]
        )
    header = ["mode", "val loss, --ep 2", "val loss, no EP", "gap ± seed noise", "verdict"]
    header += ["largest one-seed loss difference"]
    return (
        f"{caption('moe_tiny_ep')}; against {caption('moe_tiny_dp2')}; seeds "
        f"{', '.join(map(str, ep['seeds']))}; {ep['train_args']['steps']} steps\n\n"
        + table(header, rows)
    )


def expert_parallel_table() -> str:
    """Expert parallelism: all-to-all bytes per phase against bf16, bitwise one rank."""
    if missing := not_measured("expert_parallel"):
        return missing
    d = load("expert_parallel")["data"]
    rows = []
    for world in (2, 4):
        for run, label in EP_RUNS.items():
            r = d[f"ep{world}"][run]
            rows.append(
                [
                    str(world),
                    label,
                    f"{r['dispatch']:,}",
                    f"{_ep_ratio(world, run, 'dispatch'):.3f}x",
                    f"{r['combine_backward']:,}",
                    f"{_ep_ratio(world, run, 'combine_backward'):.3f}x",
                    f"{sum(r[p] for p in d['phases']):,}",
                    f"{_ep_ratio(world, run, None):.3f}x",
                    "yes" if r["bitwise_one_rank"] else "NO",
                    ", ".join(map(str, r["host_reads_per_step"])),
                ]
            )
    header = ["EP", "tokens cross as", "dispatch B", "vs bf16", "combine bwd B", "vs bf16"]
    header += ["step all-to-alls B", "vs bf16", "bitwise one rank", "host reads / step"]
    return (
        f"{caption('expert_parallel')}; dim {d['dim']}, expert hidden {d['hidden']}, "
        f"{d['experts']} experts, bf16 activations; bytes summed over the ranks and the routing "
        f"cases ({', '.join(d['cases'])}); a step: the count exchange, dispatch, combine and "
        "their backwards\n\n" + table(header, rows)
    )


def outliers_table() -> str:
    d = load("outliers")["data"]
    db = {(r["recipe"], r["gemm"]): r["float8kit_vs_fp32"] for r in d["rows"]}
    recipes = list(dict.fromkeys(r["recipe"] for r in d["rows"]))
    gemms = list(dict.fromkeys(r["gemm"] for r in d["rows"]))
    rows = [[g, *(f(db[r, g]) for r in recipes)] for g in gemms]
    return caption("outliers") + "\n\n" + table(["gemm output", *recipes], rows)


def optim_table() -> str:
    """float8kit.optim beside fp32 AdamW and torchao.optim (docs/optim.md)."""
    if missing := not_measured("optim"):
        return missing
    d = load("optim")["data"]
    cols = [
        f"{lib}_{name}" for name in ("adamw8bit", "adamw4bit") for lib in ("float8kit", "torchao")
    ]

    def mesh(r: dict) -> str:
        if r["error"]:
            return f"fails ({r['error'].split(':')[0]})"
        return "**bitwise**" if r["bitwise"] else f"no (max diff {sci(r['max_abs_diff'])})"

    rows = [
        ["state bytes / parameter", f(d["fp32_bytes_per_param"]),
         *(f(d[c]["bytes_per_param"]) for c in cols)],
        ["loss gap, mean of 3 seeds", "0", *(gap(1 + d[c]["train_gap_mean"], 1) for c in cols)],
        ["loss gap, largest", "0", *(f"{100 * d[c]['train_gap_max_abs']:.2f}%" for c in cols)],
        ["update SQNR after 20 steps (dB)", "inf",
         *(f(d[c]["update_sqnr_db"], ".1f") for c in cols)],
        ["step time / fp32 AdamW's", "1",
         *(f(d[c]["step_ms"] / d[c]["adamw_step_ms"]) + "x" for c in cols)],
        ["FSDP2, 2 ranks = one device", "-", *(mesh(d[c]["mesh2"]) for c in cols)],
        ["FSDP2, 3 ranks = one device", "-", *(mesh(d[c]["mesh3"]) for c in cols)],
    ]  # fmt: skip
    header = ["", "fp32 AdamW", *(c.replace("_adamw", " AdamW") for c in cols)]
    return caption("optim") + "\n\n" + table(header, rows)


OPTIM_SMALL = {"adamw": "demo", "adamw8bit": "optim_small_adamw8bit",
               "adamw4bit": "optim_small_adamw4bit"}  # fmt: skip


def optim_small_table() -> str:
    """The small preset's validation loss per --optim (make demo's runs: torch's AdamW), each
    mode over the same seeds: the gap to AdamW against the seed noise (compare.verdicts)."""
    import compare  # recipes/compare.py: the verdict's own rule

    for name in OPTIM_SMALL.values():
        if missing := not_measured(name):
            return missing
    data = {opt: load(name)["data"] for opt, name in OPTIM_SMALL.items()}
    same = {json.dumps([d["train_args"], d["seeds"], d["hp_dtype"]]) for d in data.values()}
    if len(same) != 1:
        names = ", ".join(OPTIM_SMALL.values())
        raise ValueError(f"{names}: the runs differ in more than --optim: re-measure them")
    rows = []
    for mode in ("none", "tensorwise"):
        stats = {opt: d["stats"][mode] for opt, d in data.items()}
        v = compare.verdicts(stats, len(data["adamw"]["seeds"]), ref="adamw")
        for opt, st in stats.items():
            val = st["val_loss"]
            cells = [mode, opt, f"{val['mean']:.4f} ± {val['sd']:.4f}"]
            if opt in v:
                g = v[opt]["val_loss"]
                cells += [f"{g['gap_pct']:+.2f}% ± {g['noise_pct']:.2f}%", g["verdict"]]
            else:
                cells += ["-", "-"]
            rows.append(cells)
    captions = "; ".join(f"{opt}: {caption(name)}" for opt, name in OPTIM_SMALL.items())
    header = ["--float8", "--optim", "val loss", "gap to adamw ± seed noise", "verdict"]
    return captions + "\n\n" + table(header, rows)


# ---------------------------------------------------------------------------- FSDP2


def fsdp_table() -> str:
    d = load("fsdp")["data"]
    ratio = d["all_gather_bytes_fp8"] / d["all_gather_bytes_bf16"]
    rows = [
        [
            "bytes all-gathered in one fwd+bwd, float8 vs bf16 all-gather (2 blocks of 64x128 + "
            "128x64 with biases, hp head; bf16 params)",
            f"{d['all_gather_bytes_fp8']:,} / {d['all_gather_bytes_bf16']:,} = **{ratio:.3f}x** "
            f"({d['all_gather_calls_fp8']} all-gathers each; biases and head stay bf16)",
        ],
        [
            "collectives in `precompute_scales`",
            f"**{d['precompute_all_reduces']}** all-reduce (for {d['float8_weights']} weights); "
            f"**{d['fwd_bwd_all_reduces_after_precompute']}** in the next forward+backward",
        ],
        [
            "collectives without `precompute_scales`",
            f"{d['forward_all_reduces_without_precompute']} all-reduces in one forward",
        ],
        [
            f"losses, 2 ranks, fp32, same global batch on every rank vs single-device float8 "
            f"({d['steps']} AdamW steps)",
            "**bitwise equal**" if d["fp32_same_batch_bitwise"] else "differ",
        ],
        [
            "losses, 2 ranks, fp32, batch split across ranks vs single-device on the global batch",
            f"{rel(d['fp32_split_rel_diff'])}",
        ],
        [
            "losses, 2 ranks, bf16 params / fp32 reduce, `reshard_after_forward=False` vs "
            "single-device autocast",
            f"{rel(d['bf16_split_rel_diff'])}",
        ],
        [
            "losses, 3 ranks, 1040/16/2-row layers (uneven + one empty shard, only float8 "
            "weights, gloo): split batch / same batch on every rank",
            f"{rel(d['uneven_split_rel_diff'])} / "
            + ("**bitwise equal**" if d["uneven_same_batch_bitwise"] else "differ"),
        ],
        [
            "precomputed scales vs `fp8_max / amax(full weight)`",
            "bitwise equal" if d["precomputed_scales_bitwise"] else "differ",
        ],
        [
            "DCP save, more steps vs fresh model + DCP load + the same steps",
            "**bitwise equal** losses" if d["dcp_resume_bitwise"] else "differ",
        ],
        [
            "`torch.compile(block, fullgraph=True)` per FSDP2 block vs eager",
            f"{rel(d['compiled_vs_eager_rel_diff'])}, {d['compiled_graph_breaks']} graph breaks",
        ],
        [
            "compile + activation checkpointing (`compile(checkpoint_wrapper(block))` per block, "
            "and the whole model compiled around checkpointed blocks), tensorwise and delayed, "
            "same batch on every rank vs single-device eager",
            f"{rel(d['compile_ac_rel_diff'])} (largest of the four)",
        ],
    ]
    for policy, what in (
        ("delayed", "DELAYED weights (`delayed` recipe)"),
        ("static", "STATIC weight (`static_scale=2048`)"),
    ):
        rows.append(
            [
                f"{what} with float8 all-gather, 2 ranks: same / split batch vs one device",
                ("**bitwise equal**" if d[f"{policy}_same_batch_bitwise"] else "differ")
                + f" / {rel(d[f'{policy}_split_rel_diff'])}; `precompute_scales` "
                f"{d[f'{policy}_precompute_all_reduces']} all-reduce, next fwd+bwd "
                f"{d[f'{policy}_fwd_bwd_all_reduces']}",
            ]
        )
    return caption("fsdp") + "\n\n" + table(["what", "result"], rows)


def _rowwise_bytes(d: dict, reshard: bool) -> str:
    key = f"reshard_{reshard}"
    sent = d[f"{key}_all_gather_bytes"] + d[f"{key}_scale_bytes"]
    bf16 = d[f"{key}_bf16_bytes"]
    return (
        f"({d[f'{key}_all_gather_bytes']:,} + {d[f'{key}_scale_bytes']:,}) / {bf16:,} = "
        f"**{sent / bf16:.3f}x**"
    )


def _sqnr(x: float | None) -> str:
    """An SQNR; None: infinite (bitwise equal; JSON has no inf)."""
    return "**bitwise equal** (inf dB)" if x is None else f"{x:.1f} dB"


def rowwise_ratio(reshard: bool = True) -> float:
    """Bytes (all-gathers + row scales) over a bf16 all-gather, ``rowwise`` recipe."""
    d = load("fsdp")["data"]["rowwise"]["rowwise"]
    key = f"reshard_{reshard}"
    return (d[f"{key}_all_gather_bytes"] + d[f"{key}_scale_bytes"]) / d[f"{key}_bf16_bytes"]


def _rowwise_recast(kind: str) -> dict[str, float]:
    """recipe -> the grad_input re-cast SQNR of ``kind`` (see the fsdp_rowwise table)."""
    rowwise = load("fsdp")["data"]["rowwise"]
    return {r: rowwise[r][f"recast_sqnr_{kind}"] for r in ("rowwise", "rowwise_with_gw_hp")}


def fsdp_rowwise_table() -> str:
    data = load("fsdp")["data"]["rowwise"]
    recipes = ("rowwise", "rowwise_with_gw_hp")
    d = {r: data[r] for r in recipes}

    def row(what: str, fn: Callable[[dict], str]) -> list[str]:
        return [what, *(fn(d[r]) for r in recipes)]

    def same(flag: bool) -> str:
        return "**bitwise equal**" if flag else "differ"

    rows = [
        row(
            "bytes in one fwd+bwd, `reshard_after_forward=True` (2 all-gathers per block): "
            "(float8 all-gathers + row scales in `precompute_scales`' all-reduce) / bf16 "
            f"all-gather (tensorwise: {data['tensorwise_reshard_True_ratio']:.3f}x)",
            lambda x: _rowwise_bytes(x, True),
        ),
        row(
            "same, `reshard_after_forward=False` (1 all-gather per block; backward re-casts "
            "the forward's gathered weight)",
            lambda x: _rowwise_bytes(x, False),
        ),
        row(
            "gradients after one step, same global batch on every rank, vs the unsharded "
            "float8 model: lowest SQNR over all parameters, `reshard_after_forward=True` / "
            "`False`",
            lambda x: (
                _sqnr(x["grad_sqnr_min_reshard_True"])
                + " / "
                + _sqnr(x["grad_sqnr_min_reshard_False"])
            ),
        ),
        row(
            "the grad_input gemm's weight re-cast from the gathered row-scaled weight vs cast "
            "from hp, SQNR: a (1040, 64) weight / its rows spread over 5 decades / without "
            "power-of-2 scales (refused by the config)",
            lambda x: " / ".join(
                _sqnr(x[f"recast_sqnr_{k}"]) for k in ("normal", "spread", "no_pow2")
            ),
        ),
        row(
            "losses, 2 ranks, fp32: same global batch on every rank / batch split across ranks, "
            "vs single-device float8 of the same recipe",
            lambda x: same(x["same_batch_bitwise"]) + " / " + rel(x["split_rel_diff"]),
        ),
        row(
            "losses, 2 ranks, bf16 params / fp32 reduce, `reshard_after_forward=False` vs "
            "single-device autocast",
            lambda x: rel(x["bf16_no_reshard_rel_diff"]),
        ),
        row(
            "losses without `precompute_scales` (the hook all-reduces each weight's row amaxes) "
            "vs with it; precomputed row scales vs the full weight's",
            lambda x: same(x["hook_path_bitwise"]) + "; " + same(x["scales_bitwise"]).lower(),
        ),
        row(
            "losses, 3 ranks, 1040/16/2-row layers (uneven + one empty shard): same batch / "
            "split batch vs one device",
            lambda x: (
                same(x["uneven_same_batch_bitwise"]) + " / " + rel(x["uneven_split_rel_diff"])
            ),
        ),
        row(
            "`torch.compile(checkpoint_wrapper(block), fullgraph=True)` per FSDP2 block, same "
            "batch on every rank, vs single-device eager",
            lambda x: same(x["compile_ac_bitwise"]) + " losses",
        ),
    ]
    notes = (
        f"A model mixing rowwise, rowwise_with_gw_hp, tensorwise and delayed blocks (all with "
        f"float8 all-gather): **{data['mix_precompute_all_reduces']}** all-reduce in "
        f"`precompute_scales`, **{data['mix_fwd_bwd_all_reduces']}** in the next "
        "forward+backward. DCP save, more steps vs fresh model + DCP load + the same steps "
        f"(rowwise, 3 uneven ranks): {same(data['dcp_resume_bitwise']).lower()} losses."
    )
    header = ["what", "`rowwise`", "`rowwise_with_gw_hp`"]
    return caption("fsdp") + "\n\n" + table(header, rows) + "\n\n" + notes


# ---------------------------------------------------------------------------- memory


def memory_table() -> str:
    d = load("memory")["data"]
    layer, step = d["per_layer"], d["train_step"]
    rows = [["bf16 `nn.Linear`", f(layer["bf16_bytes_per_token"], ".0f"), "1.00x", "hp input"]]
    for r in layer["rows"]:
        rows.append(
            [
                r["recipe"],
                f(r["bytes_per_token"], ".0f"),
                f"**{r['ratio_vs_bf16']:.2f}x**",
                "hp input (grad_weight gemm in hp)" if r["hp_grad_weight"] else "float8 input",
            ]
        )
    tokens = step["batch_size"] * step["seq_len"]
    ref = step["modes"]["none"]["live_bytes"]
    step_rows = []
    for name, m in step["modes"].items():
        mode, _, ac = name.partition("/")
        step_rows.append(
            [
                "none (bf16)" if mode == "none" else mode,
                {"": "-", "full": "full", "selective": "selective (`checkpoint_policy`)"}[ac],
                f"{m['bytes'] / 2**20:.1f}",
                f"{m['live_bytes'] / 2**20:.1f}",
                f(m["live_bytes"] / tokens, ".0f"),
                f"**{m['live_bytes'] / ref:.2f}x**",
            ]
        )
    t1, t2 = layer["tokens"]
    return (
        f"{caption('memory')}\n\n"
        f"One layer, {layer['in_features']} -> {layer['out_features']}, bf16: bytes kept for "
        f"backward per token (slope between {t1} and {t2} tokens, parameters excluded; "
        f"the target is {layer['max_ratio']:.2f}x)\n\n"
        + table(["layer", "bytes / token", "vs bf16", "what backward keeps"], rows)
        + f"\n\nOne `recipes/train.py` forward, {step['preset']} preset, batch "
        f"{step['batch_size']} x {step['seq_len']} tokens, bf16 autocast, each block "
        "checkpointed or not: the saved tensors' bytes, and the bytes of every tensor the "
        "forward made that is alive when backward starts (parameters and buffers excluded; "
        "a selective policy's cache is alive but not a saved tensor)\n\n"
        + table(
            [
                "--float8",
                "checkpointing",
                "saved MiB",
                "alive MiB",
                "alive bytes / token",
                "vs bf16",
            ],
            step_rows,
        )
    )


def monitor_drift_table() -> str:
    d = load("monitor")["data"]["drift"]

    def rows_of(report: list[dict]) -> list[list]:
        return [
            [
                f"`{r['layer']}`",
                r["gemm"],
                "inf (exact)" if r["sqnr_db"] is None else f(r["sqnr_db"], ".1f"),
                f"{100 * r['saturated']:.2f}",
                f"{100 * r['underflow']:.2f}",
                "hp" if r["fallback"] else "float8",
            ]
            for r in report
        ]

    header = ["layer", "gemm", "SQNR (dB)", "saturated %", "underflow %", "runs in"]
    fb = d["fallbacks"]
    switched = ", ".join(f"`{f['layer']}` at step {f['step']} ({f['sqnr_db']:.1f} dB)" for f in fb)
    return (
        f"{caption('monitor')}\n\n"
        f"`monitor.report()` at step {d['report'][0]['step']}, no guardrail:\n\n"
        + table(header, rows_of(d["report"]))
        + f"\n\nWith `fallback_below_db=15`: switched {switched or 'nothing'}; at step "
        f"{d['guarded_report'][0]['step']}:\n\n"
        + table(header, rows_of(d["guarded_report"]))
        + "\n\nIndependently, on new 100x data, against fp64: `fc1` (now hp) "
        f"{_sqnr(d['fc1_independent_db'])}; its float8 path {_sqnr(d['fc1_float8_db'])}."
    )


def monitor_overhead_table() -> str:
    o = load("monitor")["data"]["overhead"]
    rows = [
        [name, f(o[key], ".1f"), f"{o[key] / o['bare_ms']:.2f}x"]
        for name, key in (
            ("no monitor", "bare_ms"),
            ("monitor, unsampled step", "unsampled_ms"),
            ("monitor, sampled step", "sampled_ms"),
        )
    ]
    return (
        f"{caption('monitor')}\n\n"
        f"Forward + backward of {o['depth']} tensorwise float8 linears {o['dim']} x "
        f"{o['dim']}, {o['tokens']} tokens, one thread; median of {o['repeats']} interleaved "
        "rounds\n\n" + table(["step", "ms", "vs no monitor"], rows)
    )


def memory_compiled_table() -> str:
    d = load("memory_compiled")["data"]
    rows = [
        [
            r["recipe"],
            f(r["bytes_per_token"], ".0f"),
            f"**{r['ratio_vs_compiled_bf16']:.2f}x**",
            f"{r['ratio_vs_eager_bf16']:.2f}x",
            r["float8_saved"],
            r["forward_float8_casts"],
        ]
        for r in d["rows"]
    ]
    t1, t2 = d["tokens"]
    return (
        f"{caption('memory_compiled')}\n\n"
        f"The HF `LlamaDecoderLayer` (hidden {d['dim']}, {d['heads']} heads, SwiGLU "
        f"{d['hidden']}, bf16) compiled, no checkpointing: bytes its graph saves for backward "
        f"per token (slope from {t1} to {t2} tokens)\n\n"
        + table(
            [
                "recipe",
                "bytes / token",
                "vs compiled bf16",
                "vs eager bf16",
                "float8 tensors saved",
                "float8 casts in forward",
            ],
            rows,
        )
    )


def memory_blocks_table() -> str:
    d = load("memory_blocks")["data"]
    names = {"hf_llama": "HF `LlamaDecoderLayer` (bf16)", "recipes": "recipes' `Block` (autocast)"}
    modes = {
        "none": "-",
        "recompute_norms": "`recompute_norms`",
        "policy": "`checkpoint_policy`",
        "full": "full",
    }
    rows = []
    for kind, block_rows in d["blocks"].items():
        for r in block_rows:
            rows.append(
                [
                    names[kind],
                    "bf16" if r["recipe"] == "bf16" else r["recipe"],
                    modes[r["mode"]],
                    f"{r['bytes_at_128'] / 2**20:.2f}",
                    f(r["bytes_per_token"], ".0f"),
                    f"**{r['ratio_vs_bf16']:.2f}x**",
                    f"{r['total_ratio_vs_bf16']:.2f}x",
                ]
            )
    t1, t2 = d["tokens"]
    return (
        f"{caption('memory_blocks')}\n\n"
        f"One block, hidden {d['dim']}, {d['heads']} heads, SwiGLU {d['hidden']}: bytes kept "
        f"for backward (saved tensors and tensors the forward made that are still alive, "
        f"each storage once; parameters, buffers and the output excluded), at {t1} tokens and "
        f"per token (slope from {t1} to {t2} tokens), against the bf16 block without "
        "checkpointing\n\n"
        + table(
            [
                "block",
                "recipe",
                "checkpointing",
                f"MiB at {t1}",
                "bytes / token",
                "vs bf16 / token",
                f"vs bf16 at {t1}",
            ],
            rows,
        )
    )


def tp_table() -> str:
    d = load("tp")["data"]
    mlp, llama = d["mlp"], d["llama"]
    rows = [
        [
            f"torch's `ColwiseParallel` / `RowwiseParallel` on a converted SwiGLU MLP "
            f"({mlp['dim']}x{mlp['hidden']}, 2 ranks, fp32, {mlp['steps']} AdamW steps) vs one "
            "device",
            "; ".join(f"{k}: {rel(v)}" for k, v in d["torch_styles_rel_diff"].items()),
        ],
        [
            "float8kit's styles, sequence parallel (input `Shard(1)`, w2 output `Shard(1)`) "
            "vs one device / vs torch's hp sequence parallel",
            "; ".join(
                f"{k}: {rel(v)} / "
                + ("**bitwise equal**" if d["sp_equals_torch_sp"][k] else "differ")
                for k, v in d["sp_rel_diff"].items()
            ),
        ],
    ]
    for recipe, fp8 in d["all_gather_bytes_fp8"].items():
        bf16 = d["all_gather_bytes_bf16"][recipe]
        ratio = sum(fp8.values()) / sum(bf16.values())
        rows.append(
            [
                f"sequence-parallel all-gather bytes per rank in one fwd+bwd, {recipe}, float8 vs "
                "bf16 (forward: activations; backward: the w2 output's gradient)",
                f"{fp8['forward']:,} + {fp8['backward']:,} / {bf16['forward']:,} + "
                f"{bf16['backward']:,} = **{ratio:.3f}x**",
            ]
        )
    rows += [
        [
            "`torch.compile(fullgraph=True)` of the sequence-parallel float8 MLP vs eager",
            "**bitwise equal** losses" if d["compiled_equals_eager"] else "differ",
        ],
        [
            f"recipes' Llama (1 block, seq {llama['seq']}, {llama['steps']} steps, bf16 "
            "autocast), 2 ranks, float8 sequence parallel, each block compiled (as "
            "`train.py --tp 2 --compile`) vs eager: max loss rel. diff; graph breaks",
            "; ".join(
                f"{k}: {rel(v)}; {d['compiled_llama_graph_breaks'][k]} graph breaks"
                for k, v in d["compiled_llama_rel_diff"].items()
            ),
        ],
        [
            f"FSDP2 (2) x TP (2), 4 ranks, recipes' Llama ({llama['preset']}, seq "
            f"{llama['seq']}, {llama['steps']} steps) vs one process",
            "; ".join(
                f"{k}: {rel(v)} (FSDP2 float8 all-gather: "
                f"{'yes' if d['mesh2d_fsdp_float8_all_gather'][k] else 'no, rowwise weights'})"
                for k, v in d["mesh2d_rel_diff"].items()
            ),
        ],
        [
            "FSDP2 x TP: DCP save, more steps vs fresh model + DCP load + the same steps",
            "**bitwise equal** losses" if d["dcp_resume_bitwise"] else "differ",
        ],
    ]
    return caption("tp") + "\n\n" + table(["what", "result"], rows)


def _tp_ratio(recipe: str) -> Callable[[], str]:
    def get() -> str:
        d = load("tp")["data"]
        fp8, bf16 = d["all_gather_bytes_fp8"][recipe], d["all_gather_bytes_bf16"][recipe]
        return f"{sum(fp8.values()) / sum(bf16.values()):.2f}x"

    return get


# ---------------------------------------------------------------------------- benchmarks


def overhead_rows() -> dict[str, dict]:
    return {r["recipe"]: r for r in load("bench_overhead")["rows"]}


def _overhead_table(name: str, mode: str, extra: list[tuple[str, object]]) -> str:
    """bench_overhead's rows (``name``: its JSON), with ``extra`` (header, cells of a row)
    columns."""
    d = load(name)
    rows = [
        [
            r["recipe"],
            f(r["float8kit_us"], ".0f"),
            f(r["torchao_us"], ".0f"),
            f(r["bf16_us"], ".0f"),
            f"{r['ratio_float8kit_over_torchao']:.3f} ({r['ratio_q1']:.3f}-{r['ratio_q3']:.3f})",
            *(cells(r) for _, cells in extra),
        ]
        for r in d["rows"]
    ]
    m, k, n = d["shape"]
    header = ["recipe", "float8kit us", "torchao us", "bf16 us"]
    header += ["float8kit / torchao (median of rounds, q1-q3)", *(h for h, _ in extra)]
    return f"{caption(name)}; {m}x{k}x{n}, fwd+bwd, {mode}\n\n" + table(header, rows)


def bench_overhead_table() -> str:
    ops = "aten ops float8kit / torchao / bf16"
    return _overhead_table(
        "bench_overhead",
        "eager",
        [
            (
                ops,
                lambda r: (
                    f"{r['float8kit_aten_ops']} / {r['torchao_aten_ops']} / {r['bf16_aten_ops']}"
                ),
            ),
            (
                "by hand us (aten ops); float8kit / by hand",
                lambda r: (
                    f"{r['byhand_us']:.0f} ({r['byhand_aten_ops']}); "
                    f"{r['ratio_float8kit_over_byhand']:.2f}x"
                    if "byhand_us" in r
                    else "-"
                ),
            ),
        ],
    )


def bench_overhead_compiled_table() -> str:
    return _overhead_table(
        "bench_overhead_compiled",
        "torch.compile",
        [
            (
                "dynamo guards float8kit / torchao / bf16",
                lambda r: f"{r['float8kit_guards']} / {r['torchao_guards']} / {r['bf16_guards']}",
            ),
            (
                "guards float8kit / torchao",
                lambda r: f"{r['float8kit_guards'] / r['torchao_guards']:.2f}x",
            ),
        ],
    )


def overhead_profile_table() -> str:
    prof = load("bench_overhead")["profile"]["tensorwise"]
    fk, ao = prof["float8kit"][:6], prof["torchao"][:6]
    rows = []
    for i in range(max(len(fk), len(ao))):
        row = []
        for side in (fk, ao):
            if i < len(side):
                p = side[i]
                row += [
                    f"`{p['op']}`",
                    f(p["calls_per_step"], ".0f"),
                    f(p["self_cpu_us_per_step"], ".0f"),
                    f"{100 * p['share']:.0f}%",
                ]
            else:
                row += [""] * 4
        rows.append(row)
    return (
        f"{caption('bench_overhead')}; tensorwise, self CPU time per fwd+bwd call under "
        "torch.profiler, top ops\n\n"
        + table(
            [
                "float8kit op",
                "calls",
                "self us",
                "share",
                "torchao op",
                "calls",
                "self us",
                "share",
            ],
            rows,
        )
    )


def bench_comm_table(name: str) -> str:
    d = load(name)
    rows = [
        [
            r["variant"],
            r["status"],
            r.get("all_gather_bytes"),
            r.get("all_gather_calls"),
            r.get("all_gather_dtypes"),
            r.get("reduce_scatter_bytes"),
            r.get("reduce_scatter_calls"),
            r.get("all_reduce_bytes"),
            r.get("all_reduce_calls"),
            f(r.get("all_gather_ratio_vs_bf16"), ".3f"),
            f(r.get("total_ratio_vs_bf16"), ".3f"),
        ]
        for r in d["rows"]
    ]
    return (
        f"{caption(name)}; preset {d['preset']} ({d['n_params']:,} params), "
        f"{d['world_size']} gloo ranks, rank 0, step {d['counted_step']}\n\n"
        + table(
            [
                "variant",
                "status",
                "all-gather B",
                "AG calls",
                "AG dtypes",
                "reduce-scatter B",
                "RS calls",
                "all-reduce B",
                "AR calls",
                "AG / bf16",
                "all bytes / bf16",
            ],
            rows,
        )
    )


def linear_rows(mode: str = "fwd_bwd") -> list[dict]:
    return [r for r in load("bench_linear")["rows"] if r["mode"] == mode and not r["compiled"]]


def bench_linear_table() -> str:
    rows = [
        [
            r["M"],
            r["K"],
            r["N"],
            r["recipe"],
            f(r["bf16_ms"]),
            f(r["float8kit_ms"]),
            f(r.get("torchao_ms")),
            f(r["float8kit_speedup"]),
            f(r.get("torchao_speedup")),
            f(r["float8kit_sqnr_db"]),
            f(r.get("torchao_sqnr_db")),
        ]
        for r in linear_rows()
    ]
    return f"{caption('bench_linear')}; fwd+bwd, eager (fwd rows are in the file)\n\n" + table(
        [
            "M",
            "K",
            "N",
            "recipe",
            "bf16 ms",
            "float8kit ms",
            "torchao ms",
            "fk speedup",
            "ao speedup",
            "fk SQNR dB",
            "ao SQNR dB",
        ],
        rows,
    )


def roofline_table() -> str:
    d = load("roofline")
    r = d["rates"]
    fwd_bwd = [x for x in d["rows"] if x["mode"] == "fwd_bwd"]
    # the measured shapes, and the largest one to show where the model levels off
    shown = [x for x in fwd_bwd if x.get("measured_float8kit_speedup") is not None]
    shown += [max(fwd_bwd, key=lambda x: x["gflop"])]
    rows = [
        [
            x["M"],
            x["K"],
            x["N"],
            f(x["gflop"], ".3g"),
            f(x["bf16_pred_ms"], ".3g"),
            f(x["fp8_pred_ms"], ".3g"),
            f(x["predicted_speedup"]),
            f(x.get("measured_float8kit_speedup")),
            f(x.get("measured_torchao_speedup")),
        ]
        for x in shown
    ]
    return (
        f"{caption('roofline')}; measured at {r['measure_size']}³: bf16 "
        f"{r['bf16_tflops']:.3g} TFLOP/s, fp8 `_scaled_mm` {r['fp8_tflops']:.3g} TFLOP/s, "
        f"copy bandwidth {1e3 * r['bw_tbps']:.3g} GB/s; fixed cost per fwd+bwd call: bf16 "
        f"{r['t0_us']['bf16']['fwd_bwd']:.0f} us, float8kit "
        f"{r['t0_us']['fp8']['fwd_bwd']:.0f} us\n\n"
        + table(
            [
                "M",
                "K",
                "N",
                "GFLOP",
                "bf16 ms (pred)",
                "fp8 ms (pred)",
                "predicted",
                "measured fk",
                "measured ao",
            ],
            rows,
        )
    )


def bench_train_table(name: str) -> str:
    d = load(name)
    rows = [
        [
            r["variant"],
            f(r.get("step_ms"), ".1f"),
            f(r.get("tokens_per_s"), ".0f"),
            f(r.get("speedup_vs_bf16")),
            f(r.get("loss_first"), ".5f"),
            sci(r["loss_first_rel_diff_vs_bf16"]) if r.get("loss_first_rel_diff_vs_bf16") else "0",
            f(r.get("loss_last"), ".5f"),
        ]
        for r in d["rows"]
    ]
    return (
        f"{caption(name)}; preset {d['preset']}, {d['batch']}x{d['seq']} tokens per step, "
        f"{'compiled' if d['compiled'] else 'eager'}, median of {d['steps']} steps after "
        f"{d['warmup']} warm-up\n\n"
        + table(
            [
                "variant",
                "step ms",
                "tokens/s",
                "vs bf16",
                "loss step 1",
                "rel diff vs bf16",
                "last loss",
            ],
            rows,
        )
    )


def perf_table() -> str:
    """README's summary of the benchmarks."""
    o = overhead_rows()
    m, k, n = load("bench_overhead")["shape"]
    t = o["tensorwise"]
    others = ", ".join(
        f"{name} {r['ratio_float8kit_over_torchao']:.2f}x"
        for name, r in o.items()
        if name != "tensorwise"
    )
    comm = {
        name: {r["variant"]: r for r in load(name)["rows"]}
        for name in ("bench_comm_tiny", "bench_comm_small")
    }
    ag = comm["bench_comm_tiny"]["float8kit_fp8_allgather"]
    big = max(linear_rows(), key=lambda r: r["M"] * r["K"] * r["N"])
    lin = {
        r["recipe"]: r
        for r in linear_rows()
        if (r["M"], r["K"], r["N"]) == (big["M"], big["K"], big["N"])
    }["tensorwise"]
    rows = [
        [
            f"per-call time, {m}x{k}x{n} fwd+bwd eager, float8kit / torchao",
            f"tensorwise **{t['ratio_float8kit_over_torchao']:.2f}x** ({t['float8kit_us']:.0f} vs "
            f"{t['torchao_us']:.0f} us; {t['float8kit_aten_ops']} vs {t['torchao_aten_ops']} aten "
            f"ops), {others}",
            "`tools/measure.py bench_overhead`",
        ],
        [
            "FSDP2 bytes all-gathered per step, float8 vs bf16 all-gather (2 gloo ranks)",
            f"**{ag['all_gather_ratio_vs_bf16']:.3f}x** (tiny preset), "
            f"{comm['bench_comm_small']['float8kit_fp8_allgather']['all_gather_ratio_vs_bf16']:.3f}x"
            f" (small); {ag['all_reduce_calls']} all-reduce of {ag['all_reduce_bytes']} B per step",
            "`tools/measure.py bench_comm`",
        ],
        [
            f"one Linear fwd+bwd, {big['M']}x{big['K']}x{big['N']}, speedup over bf16, "
            "float8kit / torchao",
            f"tensorwise {lin['float8kit_speedup']:.2f}x / {lin['torchao_speedup']:.2f}x",
            "`tools/measure.py bench_linear`",
        ],
    ]
    d = load("bench_overhead")
    return (
        f"{d['device']}; torch {d['torch']}, torchao {d['torchao']}; commit "
        f"{d['git_commit'][:7]}; {d['date'][:10]} (each file in [numbers/](/numbers/) "
        "names its own)\n\n" + table(["benchmark", "result", "command"], rows)
    )


def fsdp_mesh_table() -> str:
    """Mesh x recipe: float8 vs hp all-gather losses, dp all-gather bytes, collectives."""
    d = load("fsdp_mesh")["data"]
    names = {"2x2": "FSDP2 x TP 2x2", "hsdp": "HSDP 2x2", "1x2": "FSDP2 x TP 1x2"}
    rows = []
    for mesh, label in names.items():
        for recipe, x in d[mesh].items():
            if recipe == "whole_weight_scales":
                continue
            bf16 = x["all_gather_bytes_bf16"]
            ratio = f"{x['all_gather_bytes_fp8'] / bf16:.3f}x" if bf16 else "- (one dp rank)"
            rows.append(
                [
                    label,
                    recipe,
                    "0 (**bitwise**)" if x["loss_rel_diff"] == 0 else sci(x["loss_rel_diff"]),
                    ratio,
                    x["precompute_all_reduces"],
                    x["fwd_bwd_extra_all_reduces"],
                ]
            )
    scales = all(d[m]["whole_weight_scales"] for m in names)
    return (
        caption("fsdp_mesh")
        + f"; {d['steps']} AdamW steps, dim {d['dim']}, hidden {d['hidden']}, batch "
        + f"{d['batch']} per dp rank; tensorwise scale = whole weight's on every mesh: "
        + ("yes" if scales else "NO")
        + "\n\n"
        + table(
            [
                "mesh",
                "recipe",
                "loss rel diff vs hp all-gather",
                "dp all-gather bytes fp8 / bf16",
                "precompute_scales collectives",
                "extra fwd+bwd collectives",
            ],
            rows,
        )
    )


def traffic_table() -> str:
    """benchmarks/bench_traffic.py: bytes outside the gemms per recipe, float8kit vs torchao
    vs the minimum, per shape (the torchao.float8 README shape scaled from its /16 measurement)."""
    d = load("traffic")
    rows, out = d["rows"], []
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows))
    for shape in shapes:
        at = [r for r in rows if tuple(r["shape"]) == shape]
        by = {(r["impl"], r["recipe"]): r for r in at}
        for recipe in dict.fromkeys(r["recipe"] for r in at if r["impl"] != "minimum"):
            fk = by.get(("float8kit", recipe)) or by.get(("bf16", recipe))
            ao = by.get(("torchao", recipe))
            low = by.get(("minimum", recipe))
            pe = fk.get("per_element")
            out.append(
                [
                    "x".join(map(str, shape)) + (" (scaled)" if fk.get("scaled_from") else ""),
                    recipe,
                    f(fk["bytes"] / 1e6, ".4g"),
                    f(ao["bytes"] / 1e6, ".4g") if ao else "-",
                    f(low["bytes"] / 1e6, ".4g"),
                    f(fk["bytes"] / low["bytes"]) if low["bytes"] else "-",
                    f(fk["bytes"] / ao["bytes"], ".4f") if ao else "-",
                    f"{fk['kernels']} / {ao['kernels']}" if ao else str(fk["kernels"]),
                    "/".join(f"{pe[k]:g}" for k in ("input", "weight", "grad_output"))
                    if pe
                    else "-",
                    _passes(fk, ao),
                ]
            )
    return f"{caption('traffic')}\n\n" + table(
        [
            "M x K x N",
            "recipe",
            "float8kit MB",
            "torchao MB",
            "minimum MB",
            "float8kit / minimum",
            "float8kit / torchao",
            "kernels fk / ao",
            "B per element in / w / go (fk)",
            "eager passes in / w / go (fk; ao)",
        ],
        out,
    )


def _passes(fk: dict, ao: dict | None) -> str:
    """A row's eager passes per operand, float8kit's then torchao's: "2/3/2; 13/13/13"."""

    def three(r: dict | None) -> str | None:
        p = (r or {}).get("eager_passes")
        return (
            None if p is None else "/".join(str(p[k]) for k in ("input", "weight", "grad_output"))
        )

    ours, theirs = three(fk), three(ao)
    if ours is None:
        return "-"
    return ours if theirs is None else f"{ours}; {theirs}"


def gpu_traffic_table() -> str:
    """The GPU run of bench_traffic (Triton kernels) before and after the one-pass casts."""
    after = gpu_result("casts/traffic.json")
    before = gpu_result("casts/traffic_before.json")

    def rows_of(d):
        return {(r["impl"], r["recipe"]): r for r in d["rows"]}

    a, b = rows_of(after), rows_of(before)
    out = []
    for (impl, recipe), r in a.items():
        if impl in ("minimum", "bf16"):
            continue
        low = a[("minimum", recipe)]["bytes"]
        old = b.get((impl, recipe))
        pe = r["per_element"]
        out.append(
            [
                recipe,
                impl,
                "/".join(f"{old['per_element'][k]:g}" for k in ("input", "weight", "grad_output"))
                if old
                else "-",
                "/".join(f"{pe[k]:g}" for k in ("input", "weight", "grad_output")),
                f(old["bytes"] / low) if old else "-",
                f(r["bytes"] / low),
                "/".join(str(old["eager_passes"][k]) for k in ("input", "weight", "grad_output"))
                if old
                else "-",
                "/".join(str(r["eager_passes"][k]) for k in ("input", "weight", "grad_output")),
            ]
        )
    return (
        f"{gpu_caption('casts/traffic.json')}; before: the same command on float8kit 07a013f "
        "(casts/traffic_before.json); one Linear at 4096x8192x16384, compiled on the GPU\n\n"
        + table(
            [
                "recipe",
                "library",
                "B per element in / w / go, before",
                "after",
                "/ minimum, before",
                "after",
                "eager passes, before",
                "after",
            ],
            out,
        )
    )


def gpu_casts_linear_table() -> str:
    """bench_linear on the GPU, same call: float8kit before (07a013f) and after the casts."""
    after = gpu_result("casts/linear.json")["rows"]
    before = {
        (r["recipe"], r["compiled"]): r for r in gpu_result("casts/linear_before.json")["rows"]
    }
    out = []
    for r in after:
        old = before[(r["recipe"], r["compiled"])]
        out.append(
            [
                r["recipe"],
                "compiled" if r["compiled"] else "eager",
                f(old["float8kit_ms"], ".3f"),
                f(r["float8kit_ms"], ".3f"),
                f"{old['float8kit_speedup']:.2f}x",
                f"{r['float8kit_speedup']:.2f}x",
                "-" if r.get("torchao_speedup") is None else f"{r['torchao_speedup']:.2f}x",
            ]
        )
    return (
        f"{gpu_caption('casts/linear.json')}; before: casts/linear_before.json, the same call; "
        "one Linear 4096x8192x16384, fwd+bwd (+ the scale update), median of "
        f"{gpu_result('casts/linear.json')['iters']} calls\n\n"
        + table(
            [
                "recipe",
                "mode",
                "float8kit ms, before",
                "after",
                "vs bf16, before",
                "after",
                "torchao vs bf16",
            ],
            out,
        )
    )


def gpu_cast_kernel_table() -> str:
    """bench_cast: the one-pass cast kernel per tile against inductor's kernel."""
    d = gpu_result("casts/cast.json")
    best = d["best_tile"]
    out = []
    for shape in dict.fromkeys(tuple(r["shape"]) for r in d["rows"]):
        at = [r for r in d["rows"] if tuple(r["shape"]) == shape]
        ind = next(r for r in at if r["variant"] == "inductor")
        ours = next(r for r in at if r["variant"] == "float8kit" and r["tile"] == best)
        rec = next(r for r in at if r["variant"] == "float8kit+amax" and r["tile"] == best)
        out.append(
            [
                "x".join(map(str, shape)),
                f(ind["ms"], ".4f"),
                f(ours["ms"], ".4f"),
                f(rec["ms"], ".4f"),
                f(ind["gbps"], ".0f"),
                f(ours["gbps"], ".0f"),
                "yes" if all(r["bitwise_inductor"] for r in at if "tile" in r) else "no",
            ]
        )
    return (
        f"{gpu_caption('casts/cast.json')}; bf16 in, both float8 layouts out; tile "
        f"{best[0]}x{best[1]}, {best[2]} warps (the fastest of {len(d['rows']) // 3 // 2} "
        "tried)\n\n"
        + table(
            [
                "operand M x N",
                "inductor ms",
                "float8kit ms",
                "float8kit + amax ms",
                "inductor GB/s",
                "float8kit GB/s",
                "bitwise inductor (every tile)",
            ],
            out,
        )
    )


def roofline_predicted_table() -> str:
    """float8kit.roofline: predicted fwd+bwd speedup per torchao.float8 README shape, recipe
    and device."""
    d = load("roofline_predicted")["data"]
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in d["rows"]))
    out = []
    for device in d["devices"]:
        for recipe in d["traffic"]:
            got = {
                tuple(r["shape"]): r
                for r in d["rows"]
                if r["device"] == device and r["recipe"] == recipe
            }
            cells = []
            for s in shapes:
                r = got[s]
                seen = r.get("seed_measured")
                cells.append(f"{r['speedup']:.2f}x" + (f" (seed: {seen:.2f}x)" if seen else ""))
            out.append([device, recipe, *cells])
    e = d["efficiency"]
    return (
        f"{caption('roofline_predicted')}; efficiencies (uncalibrated): bf16 gemm "
        f"{e['bf16_gemm']}, fp8 gemm {e['fp8_gemm']}, HBM {e['hbm']}\n\n"
        + table(["device", "recipe", *("x".join(map(str, s)) for s in shapes)], out)
    )


def auto_filter_table() -> str:
    """Where float8kit.auto_module_filter (H100) and torchao's _auto_filter_for_recipe differ."""
    d = load("roofline_predicted")["data"]
    rows = [x for x in d["filters"] if x["float8kit"] != x["torchao"]]
    n = len(d["filters"])
    out = [
        [
            x["recipe"],
            x["tokens"],
            x["K"],
            x["N"],
            f(x["speedup"]),
            "yes" if x["float8kit"] else "no",
            "yes" if x["torchao"] else "no",
        ]
        for x in rows
    ]
    return (
        f"{caption('roofline_predicted')}; {len(rows)} of {n} (recipe, tokens, K, N) cases "
        "differ\n\n"
        + table(
            [
                "recipe",
                "tokens (M)",
                "K",
                "N",
                "predicted speedup",
                "float8kit converts",
                "torchao converts",
            ],
            out,
        )
    )


def qgz_table() -> str:
    d = load("qgz")["data"]
    rows = []
    for world in (2, 3):
        r = d[f"ranks{world}"]
        fp8, f32, b16 = (
            r["bytes_float8_all_to_all"],
            r["bytes_fp32_reduce_scatter"],
            r["bytes_bf16_reduce_scatter"],
        )
        db = r["grad_sqnr_db"]
        setups = {k: v for k, v in db.items() if k != "e5m2"}
        ms = r["backward_ms_best"]
        rows.append(
            [
                world,
                f"{fp8:,} / {f32:,} = **{fp8 / f32:.3f}x** (bf16: {b16:,}, {fp8 / b16:.3f}x)",
                f"**{db['fp32']:.1f}** (e5m2: {db['e5m2']:.1f}; every setup >= "
                f"{min(setups.values()):.1f})",
                f"{r['late_loss']['default']:.4f} / {r['late_loss']['float8']:.4f} "
                f"({100 * r['late_loss_gap']:+.2f}%)",
                f"{ms['default']:.1f} / {ms['float8']:.1f}",
            ]
        )
    return f"{caption('qgz')}\n\n" + table(
        [
            "ranks",
            "bytes sent in one backward: float8 all-to-all / fp32 reduce-scatter",
            "first-step grad SQNR vs default, dB",
            f"mean loss steps 16-{d['ranks2']['steps']}: default / float8",
            f"backward ms (best of {d['ranks2']['backward_steps_timed']} steps): default / float8",
        ],
        rows,
    )


def qgz_train_table() -> str:
    d = load("qgz_train")["data"]
    rows = []
    for preset, p in d.items():
        runs = p["runs"]
        ref, q = runs["default"], runs["float8_reduce_scatter"]
        rows.append(
            [
                f"{preset} ({ref['steps']} steps)",
                f"{ref['train_loss']:.4f} / {q['train_loss']:.4f}",
                f"**{p['gap_pct']['train_loss']:+.2f}%**",
                f"{ref['val_loss']:.4f} / {q['val_loss']:.4f}",
                f"**{p['gap_pct']['val_loss']:+.2f}%**",
                f"{p['noise_pct']['train_loss']:+.2f}% / {p['noise_pct']['val_loss']:+.2f}%",
                f"{ref['tokens_per_s']:,.0f} / {q['tokens_per_s']:,.0f}",
            ]
        )
    return f"{caption('qgz_train')}\n\n" + table(
        [
            "preset",
            "train loss: default / float8 RS",
            "gap",
            "val loss: default / float8 RS",
            "gap",
            "seed noise (seed 1 vs 0): train / val",
            "tokens/s: default / float8 RS",
        ],
        rows,
    )


TABLES: dict[str, Callable[[], str]] = {
    "demo": lambda: compare_table("demo"),
    "demo_avx2": lambda: compare_table("demo_avx2"),
    "tiny": lambda: compare_table("tiny"),
    "moe_tiny": lambda: compare_table("moe_tiny"),
    "nvfp4_small": lambda: compare_table("nvfp4_small"),
    "experts": experts_table,
    "moe_hf": moe_hf_table,
    "numerics": numerics_table,
    "scaling": scaling_table,
    "outliers": outliers_table,
    "optim": optim_table,
    "optim_small": optim_small_table,
    "mx_numerics": mx_numerics_table,
    "nvfp4_numerics": nvfp4_numerics_table,
    "fsdp_nvfp4": fsdp_nvfp4_table,
    "fsdp_mx": fsdp_mx_table,
    "expert_parallel": expert_parallel_table,
    "moe_tiny_ep": moe_tiny_ep_table,
    "fsdp": fsdp_table,
    "fsdp_rowwise": fsdp_rowwise_table,
    "fsdp_mesh": fsdp_mesh_table,
    "qgz": qgz_table,
    "qgz_train": qgz_train_table,
    "memory": memory_table,
    "monitor_drift": monitor_drift_table,
    "monitor_overhead": monitor_overhead_table,
    "memory_blocks": memory_blocks_table,
    "memory_compiled": memory_compiled_table,
    "tp": tp_table,
    "perf": perf_table,
    "bench_overhead": bench_overhead_table,
    "bench_overhead_compiled": bench_overhead_compiled_table,
    "overhead_profile": overhead_profile_table,
    "bench_comm_tiny": lambda: bench_comm_table("bench_comm_tiny"),
    "bench_comm_small": lambda: bench_comm_table("bench_comm_small"),
    "bench_linear": bench_linear_table,
    "roofline": roofline_table,
    "traffic": traffic_table,
    "roofline_predicted": roofline_predicted_table,
    "auto_filter": auto_filter_table,
    "bench_train": lambda: bench_train_table("bench_train"),
    "bench_train_compiled": lambda: bench_train_table("bench_train_compiled"),
    "gpu_linear_compiled": lambda: gpu_linear_table("linear_compiled.json"),
    "gpu_linear_eager": lambda: gpu_linear_table("linear_eager.json"),
    "gpu_train": gpu_train_table,
    "gpu_compile": gpu_compile_table,
    "gpu_traffic": gpu_traffic_table,
    "gpu_casts_linear": gpu_casts_linear_table,
    "gpu_cast_kernel": gpu_cast_kernel_table,
    "gpu_acc_linear": gpu_acc_linear_table,
    "gpu_acc_train": gpu_acc_train_table,
    "gpu_acc_roofline": gpu_acc_roofline_table,
    "gpu_acc_targets": gpu_acc_targets_table,
    "gpu_acc_precompute": gpu_acc_precompute_table,
    "gpu_cast_op_probe": gpu_cast_op_probe_table,
    "gpu_acc_targets_previous": lambda: gpu_acc_targets_table(ACC_PREVIOUS),
    "gpu_acc_targets_first": lambda: gpu_acc_targets_table(ACC_FIRST),
    "gpu_acc_optim": gpu_acc_optim_table,
}


def _fsdp(key: str, spec: str) -> Callable[[], str]:
    def get() -> str:
        x = load("fsdp")["data"][key]
        return sci(x) if spec == "sci" else format(x, spec)

    return get


def _fsdp_blockwise(world: int, key: str) -> str:
    x = load("fsdp_blockwise")["data"][f"ranks{world}"][key]
    return sci(x) if isinstance(x, float) else str(x)


def _fsdp_blockwise_ratio(world: int) -> str:
    d = load("fsdp_blockwise")["data"][f"ranks{world}"]
    return "{:.3f}x".format(d["all_gather_bytes_fp8"] / d["all_gather_bytes_bf16"])


def _block_ratio(recipe: str, mode: str) -> str:
    rows = load("memory_blocks")["data"]["blocks"]["hf_llama"]
    r = next(r for r in rows if r["recipe"] == recipe and r["mode"] == mode)
    return f"{r['ratio_vs_bf16']:.2f}x"


def _load_avg(name: str) -> Callable[[], str]:
    """The 1-minute load average when ``name`` started (2 cores: 2.0 is a full machine)."""
    return lambda: f"{load(name)['load_avg_1m_5m_15m'][0]:.1f}"


def _cpu(name: str) -> Callable[[], str]:
    """The machine ``name`` ran on: "CPU: AMD EPYC, 2 cores, ..." -> "2 cores (AMD EPYC)"."""

    def render() -> str:
        model, cores = load(name)["device"].removeprefix("CPU: ").split(", ")[:2]
        return f"{cores} ({model})"

    return render


# the runs whose wall time and load the README states
TIMED_RUNS = ("demo", "demo_busy", "demo_avx2", "suite", "suite_avx2")


def _wall_min(name: str) -> str:
    return f"{load(name)['wall_s'] / 60:.1f} min"


def _passed(name: str) -> str:
    return str(load(name)["data"]["passed"])


def _bf16_ratio(kind: str) -> str:
    """A bf16 matmul's time over fp32's (numbers/cpu_dtype.json), as "0.26x"."""
    return "{:.2f}x".format(load("cpu_dtype")["data"][kind]["bf16_over_fp32"])


def _gpu_casts(recipe: str, compiled: bool, before: bool = False, lib: str = "float8kit"):
    """A speedup over bf16 from the GPU cast run (casts/linear*.json), as "1.52x"."""
    rel = "casts/linear_before.json" if before else "casts/linear.json"

    def get() -> str:
        (r,) = [
            r
            for r in gpu_result(rel)["rows"]
            if r["recipe"] == recipe and r["compiled"] == compiled
        ]
        return f"{r[lib + '_speedup']:.2f}x"

    return get


def _nvfp4_row(case: str, variant: str) -> dict:
    rows = load("nvfp4_numerics")["data"]["rows"]
    return next(r for r in rows if r["case"] == case and r["variant"] == variant)


def _nvfp4_db(fn) -> Callable[[], str]:
    """dB from the randn rows of the recipe and of its round-to-nearest ablation."""
    return lambda: "{:.1f} dB".format(
        fn(_nvfp4_row("randn", "nvfp4"), _nvfp4_row("randn", "no_sr"))
    )


INLINE: dict[str, Callable[[], str]] = {
    "optim.float8_all_gather_gap.adamw8bit": lambda: gap(
        1 + load("optim")["data"]["float8_all_gather_gap"]["adamw8bit"], 1
    ),
    "optim.float8_all_gather_gap.adamw4bit": lambda: gap(
        1 + load("optim")["data"]["float8_all_gather_gap"]["adamw4bit"], 1
    ),
    "nvfp4.weight_block_cost": _nvfp4_db(lambda r, _: r["torchao_cast_output"] - r["output"]),
    "nvfp4.sr_cost": _nvfp4_db(lambda r, rtn: rtn["grad_weight"] - r["grad_weight"]),
    "nvfp4.averaging_gain": _nvfp4_db(lambda r, _: r["grad_weight_averaged"] - r["grad_weight"]),
    "nvfp4.thresholds": lambda: (
        " / ".join(str(x) for x in load("nvfp4_numerics")["data"]["thresholds_db"]) + " dB"
    ),
    "nvfp4.spikes": lambda: "{:.1f}%".format(100 * load("nvfp4_numerics")["data"]["spikes"][0]),
    "gpu.casts_tensorwise_eager": _gpu_casts("tensorwise", False),
    "gpu.casts_tensorwise_eager_before": _gpu_casts("tensorwise", False, before=True),
    "gpu.casts_delayed_eager": _gpu_casts("delayed", False),
    "gpu.casts_delayed_eager_before": _gpu_casts("delayed", False, before=True),
    "gpu.casts_static_eager": _gpu_casts("static", False),
    "gpu.casts_tensorwise_compiled": _gpu_casts("tensorwise", True),
    "gpu.casts_delayed_compiled": _gpu_casts("delayed", True),
    "gpu.casts_static_compiled": _gpu_casts("static", True),
    "gpu.casts_tensorwise_eager_ao": _gpu_casts("tensorwise", False, lib="torchao"),
    "ep.dispatch_rowwise": lambda: f"{_ep_ratio(2, 'rowwise/float8/bfloat16', 'dispatch'):.3f}x",
    "ep.dispatch_mx": lambda: f"{_ep_ratio(2, 'mxfp8/float8/bfloat16', 'dispatch'):.3f}x",
    "ep.step_rowwise": lambda: f"{_ep_ratio(2, 'rowwise/float8/bfloat16', None):.3f}x",
    "gpu.train_tensorwise_fk": _gpu_train_speedup("float8kit:tensorwise"),
    "gpu.compile_sqnr": lambda: "{:.0f} dB".format(
        gpu_result("compile_precision.json")["rows"][0]["out_sqnr_db"]
    ),
    "gpu_acc.gpu_tests": _acc_pytest("acceptance/gpu_tests.log"),
    "gpu_acc.memory_tests": _acc_pytest("acceptance/memory.log"),
    "gpu_acc.optim_tests": _acc_pytest("optim/optim_tests.log"),
    "gpu_acc.adamw8bit_fk": _acc_optim("float8kit adamw8bit"),
    "gpu_acc.adamw8bit_ao": _acc_optim("torchao adamw8bit"),
    "gpu_acc.adamw4bit_fk": _acc_optim("float8kit adamw4bit"),
    "gpu_acc.adamw4bit_ao": _acc_optim("torchao adamw4bit"),
    "gpu_acc.tensorwise_fk": _acc_speedup("tensorwise", "float8kit"),
    "gpu_acc.tensorwise_ao": _acc_speedup("tensorwise", "torchao"),
    "gpu_acc.tensorwise_fk_synced": _acc_speedup("tensorwise", "float8kit", synced=True),
    "gpu_acc.tensorwise_ao_synced": _acc_speedup("tensorwise", "torchao", synced=True),
    "gpu_acc.rowwise_fk": _acc_speedup("rowwise", "float8kit"),
    "gpu_acc.rowwise_ao": _acc_speedup("rowwise", "torchao"),
    "gpu_acc.train_tensorwise_fk": _acc_train("float8kit:tensorwise"),
    "gpu_acc.train_tensorwise_ao": _acc_train("torchao:tensorwise"),
    "gpu_acc.train_delayed_fk": _acc_train("float8kit:delayed"),
    "fsdp.ag_ratio": lambda: "{:.3f}x".format(
        load("fsdp")["data"]["all_gather_bytes_fp8"] / load("fsdp")["data"]["all_gather_bytes_bf16"]
    ),
    "fsdp.fp32_split": _fsdp("fp32_split_rel_diff", "sci"),
    "fsdp.rowwise_ag_ratio": lambda: f"{rowwise_ratio():.3f}x",
    "fsdp.recast_spread_sqnr": lambda: "{:.0f} dB".format(min(_rowwise_recast("spread").values())),
    "fsdp.recast_no_pow2_sqnr": lambda: "{:.0f} dB".format(
        max(_rowwise_recast("no_pow2").values())
    ),
    "tp.ag_ratio_tensorwise": _tp_ratio("tensorwise"),
    "tp.ag_ratio_rowwise": _tp_ratio("rowwise"),
    "fsdp.bf16_split": _fsdp("bf16_split_rel_diff", "sci"),
    "fsdp.uneven_split": _fsdp("uneven_split_rel_diff", "sci"),
    "fsdp.precompute_all_reduces": _fsdp("precompute_all_reduces", "d"),
    **{f"fsdp_blockwise.ag_ratio_{w}": functools.partial(_fsdp_blockwise_ratio, w) for w in (2, 3)},
    **{
        f"fsdp_blockwise.split_{w}": functools.partial(_fsdp_blockwise, w, "split_rel_diff")
        for w in (2, 3)
    },
    **{
        f"fsdp_blockwise.all_reduces_{w}": functools.partial(
            _fsdp_blockwise, w, "fwd_bwd_all_reduces"
        )
        for w in (2, 3)
    },
    "fsdp.fwd_bwd_all_reduces": _fsdp("fwd_bwd_all_reduces_after_precompute", "d"),
    "numerics.old_scale_off_e4m3": lambda: "{:.1%}".format(
        load("numerics")["data"]["old_scale_form_off_share"]["torch.float8_e4m3fn"]
    ),
    "memory_blocks.hf_tensorwise": lambda: _block_ratio("tensorwise", "none"),
    "memory_blocks.hf_tensorwise_norms": lambda: _block_ratio("tensorwise", "recompute_norms"),
    **{f"{n}.wall_min": functools.partial(_wall_min, n) for n in TIMED_RUNS},
    **{f"{n}.load": _load_avg(n) for n in TIMED_RUNS},
    **{f"{name}.cpu": _cpu(name) for name in ("demo", "suite")},
    **{f"{n}.passed": functools.partial(_passed, n) for n in ("suite", "suite_avx2")},
    # (a suite measured before make test had workers ran one process)
    "suite.workers": lambda: str(load("suite")["data"].get("workers", 1)),
    "cpu_dtype.native_ratio": lambda: _bf16_ratio("native"),
    "cpu_dtype.avx2_ratio": lambda: _bf16_ratio("avx2"),
    "numbers.total_min": lambda: "{} min".format(
        math.ceil(
            sum(json.loads(p.read_text()).get("wall_s", 0) for p in NUMBERS.glob("*.json")) / 60
        )
    ),
}


# ---------------------------------------------------------------------------- render / check


def render(text: str) -> str:
    """``text`` with every marked block and inline number re-rendered from numbers/."""

    def block(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise KeyError(f"<!-- table:{name} -->: no such table (known: {', '.join(TABLES)})")
        return f"{m.group(1)}\n{TABLES[name]()}\n\n{m.group(4)}"

    def inline(m: re.Match) -> str:
        key = m.group(2)
        if key not in INLINE:
            raise KeyError(f"<!-- n:{key} -->: no such number (known: {', '.join(INLINE)})")
        try:
            value = INLINE[key]()
        except FileNotFoundError:  # a new number, before its first measurement
            value = f"(not measured yet: python tools/measure.py {key.split('.')[0]})"
        return f"{m.group(1)}{value}{m.group(4)}"

    return INLINE_RE.sub(inline, TABLE_RE.sub(block, text))


def used(text: str) -> tuple[set[str], set[str]]:
    """The table names and inline keys ``text`` uses."""
    return (
        {m.group(2) for m in TABLE_RE.finditer(text)},
        {m.group(2) for m in INLINE_RE.finditer(text)},
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 on a difference")
    args = p.parse_args()
    stale = []
    for name in DOCS:
        path = REPO / name
        text = path.read_text()
        new = render(text)
        if new != text:
            stale.append(name)
            if not args.check:
                path.write_text(new)
    verb = "differ from numbers/ (run python tools/publish.py)" if args.check else "rewritten"
    print(f"{', '.join(stale)}: {verb}" if stale else "all published numbers match numbers/")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
