"""Train the same model on the same data and seeds in high precision and with float8.

    python recipes/compare.py --preset small --out runs/compare_small   # hp vs tensorwise
    python recipes/compare.py --preset small --modes none,tensorwise,rowwise --out runs/cmp3

Every flag compare.py does not know is passed to train.py unchanged (--preset, --steps,
--batch-size, --seq-len, --lr, --seed, --data, --hp-dtype, --compile, --device, ...);
--float8, --seed and --out are set per run. Each mode trains once per seed (--seeds N: seed,
seed+1, ..., a different init and batch order each), every mode over the same seeds. Each
run is a train.py process writing OUT/MODE_seedS/ (its own config.json and metrics.jsonl);
on CPU up to one run per core at a time (--jobs), each with train.py's one thread;
--nproc N runs each under torchrun with N ranks (with train.py's --ep: expert parallel). Runs
are independent and single-threaded, so running them side by side changes no loss. Then
OUT/report.md (the table printed at the end) and OUT/loss.png (loss curves) are written
from those metrics.jsonl files, so every number in the report can be recomputed from them
(with train.py's --monitor N, also OUT/monitor.png: each mode's per-layer SQNR at its last
sampled step, from MODE_seedS/monitor.jsonl of the first seed):

- hp: the high-precision dtype every run computes in outside the float8 gemms (train.py
  --hp-dtype; auto = bf16 on GPUs and on CPUs with native bf16, fp32 on the others, where
  emulated bf16 runs many times slower); the reference mode `none` is "hp (DTYPE)";
- per run: train loss = mean of the last 10 logged training losses (one batch is noisy);
  val loss = the val_loss logged at the last step (fixed validation windows, same for all);
- per mode: the mean and the sample standard deviation (sd) of those over its seeds;
- gap: (mode mean - hp mean) / hp mean, in %;
- seed noise: two standard errors of that difference of means, 2 * sqrt(sd_mode^2 / n +
  sd_hp^2 / n) / hp mean, in % (n seeds per mode);
- verdict: "within noise" when |gap| <= seed noise (the seeds alone could make that gap:
  no evidence that the mode learns worse or better than hp), else "worse" or "better".
  With one seed (--seeds 1) there is no spread and no verdict;
- float8 layers: how many Linears (and MoE expert weights) the mode converted, and their
  share of the gemm FLOPs per token (train.py's config.json).

No speed column: the runs share the machine with each other and with whatever else runs,
so their tokens/s (in MODE_seedS/metrics.jsonl) measure the load as much as the mode, and
on a CPU float8 has no hardware to run on and is only slower (the casts are extra passes).
The float8 speedup is a GPU measurement: benchmarks/bench_train.py, docs/performance.md.

Every line a run prints is prefixed with its run name ([tensorwise_seed0], ...). The
default data is the corpus shipped in recipes/corpus/ (its sha256 is in the report), so
losses agree across machines up to the CPU's kernels: they are deterministic on one machine
and thread count, but differ in the last digits between CPU models (Intel and AMD kernels
round differently) and between hp dtypes. OUT/summary.json holds the report's numbers.
loss.png needs matplotlib (the recipes extra); without it compare.py refuses before the
first run, or skips the plots with --no-plot.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli  # noqa: E402  (train.py's flags; no torch: --help and usage errors answer at once)

TRAIN_TAIL = 10  # training losses averaged for the "train loss" column
METRICS = ("train_loss", "val_loss")


def summarize(records: list[dict]) -> dict:
    """The report's numbers for one run, from its metrics.jsonl records."""
    losses = [r["loss"] for r in records]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    return {
        "steps": records[-1]["step"],
        "train_loss": statistics.fmean(losses[-TRAIN_TAIL:]),
        "val_loss": vals[-1],
    }


def run_name(mode: str, seed: int) -> str:
    return f"{mode}_seed{seed}"


def mode_stats(runs: dict[str, dict], modes: list[str], seeds: list[int]) -> dict:
    """Per mode and metric: the values over the seeds (in seed order), their mean and sample
    standard deviation (None with one seed)."""
    stats = {}
    for mode in modes:
        stats[mode] = {}
        for key in METRICS:
            xs = [runs[run_name(mode, s)][key] for s in seeds]
            sd = statistics.stdev(xs) if len(xs) > 1 else None
            stats[mode][key] = {"values": xs, "mean": statistics.fmean(xs), "sd": sd}
    return stats


def verdicts(stats: dict, n: int, ref: str = "none") -> dict:
    """Per float8 mode and metric: the gap of its mean to the hp mean (%), the seed noise
    (two standard errors of the difference of the means, % of the hp mean; None with one
    seed) and the verdict: "within noise" when |gap| <= noise, else "worse" or "better"."""
    out = {}
    for mode, by_key in stats.items():
        if mode == ref:
            continue
        out[mode] = {}
        for key, x in by_key.items():
            r = stats[ref][key]
            gap = 100 * (x["mean"] - r["mean"]) / r["mean"]
            noise = None
            if x["sd"] is not None:
                noise = 200 * math.sqrt((x["sd"] ** 2 + r["sd"] ** 2) / n) / r["mean"]
            if noise is None:
                word = "n/a (one seed)"
            elif abs(gap) <= noise:
                word = "within noise"
            else:
                word = "worse" if gap > 0 else "better"
            out[mode][key] = {"gap_pct": gap, "noise_pct": noise, "verdict": word}
    return out


def coverage_text(c: dict | None) -> str:
    """config.json's float8_layers in a table cell."""
    if not c:
        return "-"
    text = f"{c['linears']}/{c['linears_total']} Linears"
    if c["expert_weights_total"]:
        text += f", {c['expert_weights']}/{c['expert_weights_total']} expert weights"
    return text + f" ({100 * c['gemm_flops_share']:.1f}% of gemm FLOPs)"


def report_table(summary: dict) -> str:
    """The report's table from summary.json's numbers (tools/publish.py renders the README's
    copy with this same function)."""
    stats, verdict, hp = summary["stats"], summary["verdicts"], summary["hp_dtype"]
    n = len(summary["seeds"])
    header = [
        "mode",
        f"train loss, mean ± sd ({n} seeds)",
        f"val loss, mean ± sd ({n} seeds)",
        "train gap vs hp ± seed noise",
        "val gap vs hp ± seed noise",
        "verdict (train, val)",
        "float8 layers",
    ]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def pm(x: dict) -> str:
        return f"{x['mean']:.4f}" + ("" if x["sd"] is None else f" ± {x['sd']:.4f}")

    for mode in summary["modes"]:
        s = stats[mode]
        cells = [f"none (hp {hp})" if mode == "none" else mode, pm(s["train_loss"])]
        cells.append(pm(s["val_loss"]))
        if mode in verdict:
            v = verdict[mode]
            for key in METRICS:
                noise = v[key]["noise_pct"]
                cells.append(
                    f"{v[key]['gap_pct']:+.2f}%" + ("" if noise is None else f" ± {noise:.2f}%")
                )
            cells.append(", ".join(v[key]["verdict"] for key in METRICS))
        else:
            cells += ["-", "-", "-"]
        cells.append(coverage_text(summary["float8_layers"].get(mode)))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _smoothed(records: list[dict]) -> list[float]:
    # Trailing mean over TRAIN_TAIL steps: the table's "train loss" at every step.
    losses = [r["loss"] for r in records]
    return [
        statistics.fmean(losses[max(0, i + 1 - TRAIN_TAIL) : i + 1]) for i in range(len(losses))
    ]


def plot(
    runs: dict[str, list[dict]], modes: list[str], seeds: list[int], path: Path, title: str, hp: str
) -> None:
    """loss.png: each mode's train loss (mean over its seeds, shaded from their min to their
    max) and val loss; beside it each float8 mode's gap to the hp mean, over the band the hp
    seeds spread around their own mean."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, (ax, axg) = plt.subplots(1, 2, figsize=(12, 4.5))
    curves = {}
    for mode in modes:
        recs = [runs[run_name(mode, s)] for s in seeds]
        steps = [r["step"] for r in recs[0]]
        per_step = list(zip(*map(_smoothed, recs), strict=True))  # [step][seed]
        mean = [statistics.fmean(v) for v in per_step]
        curves[mode] = (steps, mean, per_step)
        label = f"hp ({hp})" if mode == "none" else mode
        (line,) = ax.plot(steps, mean, label=f"{label} train, mean of {len(seeds)} seeds")
        if len(seeds) > 1:
            lo, hi = [min(v) for v in per_step], [max(v) for v in per_step]
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
        val_steps = [r["step"] for r in recs[0] if "val_loss" in r]
        vals = [
            statistics.fmean(r["val_loss"] for rs in recs for r in rs if r["step"] == st)
            for st in val_steps
        ]
        ax.plot(val_steps, vals, "o--", color=line.get_color(), label=f"{label} val, mean")
    # Clip the first 10% of steps' steep drop so the late-training gaps are visible.
    tops = [y[len(y) // 10] for _, y, _ in curves.values()]
    bottom = min(min(y) for _, y, _ in curves.values())
    ax.set_ylim(top=max(tops) + 0.05 * (max(tops) - bottom))
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title=title)
    ax.legend()
    if "none" in curves:
        steps, ref, ref_seeds = curves["none"]
        if len(seeds) > 1:  # how far the hp seeds alone spread around their mean
            lo = [100 * (min(v) - m) / m for v, m in zip(ref_seeds, ref, strict=True)]
            hi = [100 * (max(v) - m) / m for v, m in zip(ref_seeds, ref, strict=True)]
            axg.fill_between(steps, lo, hi, color="gray", alpha=0.3, label="hp seeds vs their mean")
        for mode, (s, y, _) in curves.items():
            if mode != "none":
                axg.plot(s, [100 * (a - b) / b for a, b in zip(y, ref, strict=True)], label=mode)
        axg.axhline(0, color="gray", lw=0.8)
        axg.set(xlabel="step", ylabel="train loss gap vs hp mean (%)", title=f"float8 - hp ({hp})")
        axg.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_monitor(out: Path, modes: list[str], path: Path) -> dict[str, dict[str, list]]:
    """monitor.png: each mode's per-layer SQNR at its last sampled step, one panel per gemm,
    from OUT/MODE/monitor.jsonl (train.py --monitor N). Returns the plotted series, mode ->
    gemm -> [(layer, dB)]; nothing is written when no mode has a monitor.jsonl."""
    series: dict[str, dict[str, list]] = {}
    for mode in modes:
        log = out / mode / "monitor.jsonl"
        if not log.exists() or not log.read_text().strip():
            continue
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        last = max(r["step"] for r in rows)
        series[mode] = {}
        for r in rows:
            if r["step"] == last:
                series[mode].setdefault(r["gemm"], []).append((r["layer"], r["sqnr_db"]))
    if not series:
        return series
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gemms = ["output", "grad_input", "grad_weight"]
    fig, axes = plt.subplots(len(gemms), 1, figsize=(12, 9), sharex=True)
    for ax, gemm in zip(axes, gemms, strict=True):
        for mode, by_gemm in series.items():
            pts = by_gemm.get(gemm, [])
            # an exact (hp) gemm is logged as null: drawn as a gap
            ys = [float("nan") if db is None else db for _, db in pts]
            ax.plot(range(len(pts)), ys, "o-", label=mode)
            labels = [layer for layer, _ in pts]
        ax.set(ylabel="SQNR vs fp32 (dB)", title=f"{gemm} gemm, last sampled step")
        ax.legend()
    axes[-1].set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return series


def _forward(name: str, stream) -> None:
    for line in stream:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


def run_modes(runs: dict[str, list[str]], out: Path, jobs: int, nproc: int = 1) -> None:
    """train.py once per run (name -> its flags), as child processes, at most ``jobs`` at a
    time (``nproc`` > 1: each under ``torchrun --standalone``, ``nproc`` ranks); every line a
    run prints is prefixed with its name."""
    script = str(Path(__file__).resolve().parent / "train.py")
    launch = [sys.executable]
    if nproc > 1:  # torchrun picks a free port per run and gives each rank one thread
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    pending = list(runs)
    running: dict[str, tuple[subprocess.Popen, threading.Thread]] = {}
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            cmd = [*launch, script, *runs[name], "--out", str(out / name), "--overwrite"]
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
            )
            pump = threading.Thread(target=_forward, args=(name, proc.stdout), daemon=True)
            pump.start()
            running[name] = (proc, pump)
        time.sleep(0.2)
        for name, (proc, pump) in list(running.items()):
            if proc.poll() is None:
                continue
            pump.join()
            del running[name]
            if proc.returncode:
                for other, _ in running.values():
                    other.terminate()
                sys.exit(f"compare.py: the {name} run failed (exit {proc.returncode})")


# train.py's flags that compare.py sets per run (and --seed, passed through: the first seed)
PER_RUN = ("float8", "out", "resume", "checkpoint_every", "overwrite", "memory")


def passthrough_help() -> str:
    """--help text for the train.py flags compare.py passes through."""
    tp = cli.build_parser()
    fmt = tp._get_formatter()
    fmt.start_section("passed to train.py unchanged (train.py --help)")
    fmt.add_arguments(
        [a for a in tp._actions if a.option_strings and a.dest not in PER_RUN + ("help",)]
    )
    fmt.end_section()
    return fmt.format_help()


def missing_extras(plots: bool) -> list[str]:
    """The recipes extra's packages this comparison needs and this Python lacks: tqdm (every
    train.py run), matplotlib (loss.png, unless --no-plot)."""
    need = ["tqdm"] + (["matplotlib"] if plots else [])
    return [m for m in need if importlib.util.find_spec(m) is None]


def main(argv: list[str] | None = None) -> dict:
    p = cli.Parser(
        prog="compare.py",
        description=__doc__.split("\n")[0],
        epilog=passthrough_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # rowwise is opt-in: it is the slowest mode on CPU, and every mode is --seeds more runs.
    p.add_argument(
        "--modes",
        default="none,tensorwise",
        help="comma-separated --float8 modes to run; 'none' is the hp reference",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="runs per mode, with seeds --seed .. --seed+N-1 (the same for every mode); the "
        "seed noise and the verdict need >= 2 (default 3)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default runs/compare_PRESET); a folder that holds a comparison "
        "is refused unless --overwrite",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the comparison in --out")
    p.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="runs at a time (default 0 = one per CPU core on CPU, 1 on a GPU)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes per run (torchrun --standalone, gloo on CPU): data parallel, and "
        "expert parallel with train.py's --ep (default 1)",
    )
    p.add_argument(
        "--no-plot",
        action="store_true",
        help="write no loss.png / monitor.png (then matplotlib is not needed)",
    )
    args, train_argv = p.parse_known_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in cli.FLOAT8_MODES]
    if bad or not modes:
        p.error(
            f"--modes: unknown mode(s) {','.join(bad) or '(none)'}; "
            f"choose from {','.join(cli.FLOAT8_MODES)}"
        )
    if len(set(modes)) != len(modes):
        p.error(f"--modes {args.modes}: a mode is repeated")
    for dest in PER_RUN:
        flag = "--" + dest.replace("_", "-")
        if any(a == flag or a.startswith(flag + "=") for a in train_argv):
            p.error(f"{flag} is set by compare.py per run; leave it out")
    if args.jobs < 0 or args.seeds < 1 or args.nproc < 1:
        p.error("--jobs must be >= 0, --seeds >= 1 and --nproc >= 1")
    base = cli.parse_args(train_argv)  # validates the shared flags once, up front
    missing = missing_extras(not args.no_plot)
    if missing:  # before the first run, not after all of them
        p.error(
            f"{', '.join(missing)} not installed: the recipes need their extra: "
            'pip install -e ".[recipes]"'
            + (" (or pass --no-plot to skip loss.png)" if missing == ["matplotlib"] else "")
        )
    out = Path(args.out or f"runs/compare_{base.preset}")
    if (out / "summary.json").exists() or (out / "report.md").exists():
        if not args.overwrite:
            p.error(f"--out {out} already holds a comparison: pass --overwrite, or another --out")

    import torch  # only now: --help and usage errors above never wait for it

    on_gpu = base.device == "cuda" or (base.device == "auto" and torch.cuda.is_available())
    jobs = args.jobs or (1 if on_gpu else max(1, (os.cpu_count() or 1) // args.nproc))
    seeds = [base.seed + i for i in range(args.seeds)]
    # Seed-major, float8 modes before hp within a seed: the runs that overlap on the machine
    # are the modes of one seed, and the slower float8 runs start first (on 2 cores the last
    # run left alone is then a short hp one).
    order = sorted(modes, key=lambda m: m == "none")
    runs_argv = {
        run_name(m, s): [*train_argv, "--float8", m, "--seed", str(s)] for s in seeds for m in order
    }
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    run_modes(runs_argv, out, jobs, args.nproc)
    wall = time.perf_counter() - t0
    records, configs = {}, {}
    for name in runs_argv:
        path = out / name / "metrics.jsonl"
        records[name] = [json.loads(line) for line in path.read_text().splitlines()]
        configs[name] = json.loads((out / name / "config.json").read_text())
    cfg = configs[run_name(modes[0], seeds[0])]
    runs = {name: summarize(r) for name, r in records.items()}
    stats = mode_stats(runs, modes, seeds)
    summary = {
        "modes": modes,
        "seeds": seeds,
        "hp_dtype": cfg["hp_dtype"],
        "runs": runs,
        "stats": stats,
        "verdicts": verdicts(stats, len(seeds)) if "none" in modes else {},
        "float8_layers": {
            m: configs[run_name(m, seeds[0])]["float8_layers"] for m in modes if m != "none"
        },
        "data": cfg["data"],
    }
    table = report_table(summary)
    cmd = argv if argv is not None else sys.argv[1:]
    title = f"{base.preset}: {base.steps} steps, batch {base.batch_size} x {base.seq_len} bytes"
    data = cfg["data"]
    text = "\n".join(
        [
            f"# float8 vs hp ({cfg['hp_dtype']}): {title}",
            "",
            table,
            "",
            f"- command: `python recipes/compare.py {' '.join(cmd)}`",
            f"- device: {cfg['device']}, hp dtype {cfg['hp_dtype']}, torch {cfg['torch']}, "
            f"float8kit {cfg['float8kit']}, {cfg['n_params']:,} params, seeds "
            f"{', '.join(map(str, seeds))} for every mode",
            f"- data: {data['source']} ({data['files']} files, {data['bytes']:,} bytes), "
            f"sha256 {data['sha256']}",
            f"- train loss = mean of the last {TRAIN_TAIL} steps of a run; val loss = at its "
            "last step; mean ± sd over the seeds; seed noise = 2 standard errors of the "
            "difference of the means; verdict: within noise when |gap| <= seed noise, else "
            "worse or better (compare.py's docstring)",
            "- speed: not compared (runs overlap and meet different load; on a CPU float8 has "
            "no hardware and is only slower): benchmarks/bench_train.py measures it on a GPU",
            f"- wall time {wall:.0f} s; per-step numbers: MODE_seedS/metrics.jsonl"
            + ("" if args.no_plot else "; curves: loss.png"),
            "",
        ]
    )
    (out / "report.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    wrote = [out / "report.md"]
    if not args.no_plot:
        plot(records, modes, seeds, out / "loss.png", title, cfg["hp_dtype"])
        wrote.append(out / "loss.png")
        first = [run_name(m, seeds[0]) for m in modes]
        if plot_monitor(out, first, out / "monitor.png"):  # train.py --monitor N was passed
            with (out / "report.md").open("a") as f:
                f.write(
                    "- per-layer SQNR (--monitor): MODE_seedS/monitor.jsonl; plot: monitor.png\n"
                )
            wrote.append(out / "monitor.png")
    print(f"\n{table}\n\nwrote {' and '.join(map(str, wrote))} ({wall:.0f} s)")
    return summary


if __name__ == "__main__":
    main()
