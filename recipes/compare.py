"""Train the same model on the same data and seed in bf16 and with float8; report the gap.

    python recipes/compare.py --preset small --out runs/compare_small   # bf16 vs tensorwise
    python recipes/compare.py --preset small --modes none,tensorwise,rowwise --out runs/cmp3

Every flag compare.py does not know is passed to train.py unchanged (--preset, --steps,
--batch-size, --seq-len, --lr, --seed, --data, --compile, --device, ...); --float8 and --out
are set per mode. Each run is a train.py process writing OUT/MODE/ (its own config.json and
metrics.jsonl); on CPU up to one run per core at a time (--jobs), each with train.py's one
thread, so two modes on two cores take the time of the slower one. Runs are independent
and single-threaded, so running them side by side changes no loss; tokens/s of runs that
overlap share the machine's memory bandwidth. Then OUT/report.md (the table printed
at the end) and OUT/loss.png (loss curves) are written from those metrics.jsonl files, so
every number in the report can be recomputed from them (with train.py's --monitor N, also
OUT/monitor.png: each mode's per-layer SQNR at its last sampled step, from MODE/monitor.jsonl):

- train loss: mean of the last 10 logged training losses (one batch is noisy);
- val loss: the val_loss logged at the last step (fixed validation windows, same for all);
- gap: (mode - bf16) / bf16 in %;
- tokens/s: median over the steps after the first 3 (those include warm-up and compile);
- speedup: tokens/s over the bf16 run's tokens/s;
- bf16 seed noise: the bf16 run again with --noise-seeds other seeds (seed+1, seed+2, ...: a
  different init and batch order); the largest |gap| of those runs against the bf16 run is the
  noise band, and each float8 gap is marked inside or outside it. A gap inside the band is
  no evidence that the mode learns worse or better than bf16.

Every line a run prints is prefixed with its run name ([tensorwise], [none_seed1], ...).
Losses are deterministic on one machine and thread count, but differ in the last digits
between CPU models (Intel and AMD kernels round differently), so compare runs made on one
machine. OUT/summary.json holds the report's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train  # noqa: E402

TRAIN_TAIL = 10  # training losses averaged for the "train loss" column
WARMUP_STEPS = 3  # steps left out of the tokens/s median


def summarize(records: list[dict]) -> dict:
    """The report's numbers for one run, from its metrics.jsonl records."""
    losses = [r["loss"] for r in records]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    speeds = [r["tokens_per_s"] for r in records]
    steady = speeds[WARMUP_STEPS:] or speeds
    return {
        "steps": records[-1]["step"],
        "train_loss": statistics.fmean(losses[-TRAIN_TAIL:]),
        "val_loss": vals[-1],
        "tokens_per_s": statistics.median(steady),
    }


def gap(x: float, ref: float) -> str:
    return f"{100 * (x - ref) / ref:+.2f}%"


def noise_band(summaries: dict[str, dict], extra: list[str]) -> dict | None:
    """The bf16 seed noise: the largest |gap| (in %) of the extra bf16 runs against the bf16
    run, for the train and the val loss. None without extra runs."""
    ref = summaries.get("none")
    if not extra or ref is None:
        return None
    band = {}
    for key in ("train_loss", "val_loss"):
        band[key] = max(abs(100 * (summaries[r][key] - ref[key]) / ref[key]) for r in extra)
    return band


def inside(x: float, ref: float, band: float) -> bool:
    return abs(100 * (x - ref) / ref) <= band


def report_table(summaries: dict[str, dict], modes: list[str], noise: dict | None) -> str:
    ref = summaries.get("none")
    header = "| mode | train loss | val loss | train gap vs bf16 | val gap vs bf16 |"
    if noise:
        header += " inside bf16 seed noise (train, val) |"
    rows = [header + " tokens/s | speedup |", "|---" * (header.count("|") + 1) + "|"]
    for mode in modes:
        s = summaries[mode]
        name = "none (bf16)" if mode == "none" else mode
        tg = gap(s["train_loss"], ref["train_loss"]) if ref else "n/a"
        vg = gap(s["val_loss"], ref["val_loss"]) if ref else "n/a"
        sp = f"{s['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "n/a"
        row = f"| {name} | {s['train_loss']:.4f} | {s['val_loss']:.4f} | {tg} | {vg} |"
        if noise:
            verdict = [
                "yes" if inside(s[k], ref[k], noise[k]) else "no"
                for k in ("train_loss", "val_loss")
            ]
            row += " - |" if mode == "none" else f" {verdict[0]}, {verdict[1]} |"
        rows.append(row + f" {s['tokens_per_s']:.0f} | {sp} |")
    if noise:
        rows.append("")
        rows.append(
            f"bf16 seed noise: train {noise['train_loss']:.2f}%, val {noise['val_loss']:.2f}% "
            "(largest |gap| of the bf16 runs with other seeds)"
        )
    return "\n".join(rows)


def plot(runs: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, (ax, axg) = plt.subplots(1, 2, figsize=(12, 4.5))
    smooth = {}
    for mode, recs in runs.items():
        steps = [r["step"] for r in recs]
        losses = [r["loss"] for r in recs]
        # Trailing mean over TRAIN_TAIL steps, the table's "train loss" at every step.
        out = [
            statistics.fmean(losses[max(0, i + 1 - TRAIN_TAIL) : i + 1]) for i in range(len(losses))
        ]
        smooth[mode] = (steps, out)
        (line,) = ax.plot(steps, out, label=f"{mode} train (mean of last {TRAIN_TAIL})")
        vs = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
        ax.plot(*zip(*vs, strict=True), "o--", color=line.get_color(), label=f"{mode} val")
    # Clip the first 10% of steps' steep drop so the late-training gaps are visible.
    tops = [y[len(y) // 10] for _, y in smooth.values()]
    ax.set_ylim(top=max(tops) + 0.05 * (max(tops) - min(min(y) for _, y in smooth.values())))
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title=title)
    ax.legend()
    if "none" in smooth:
        steps, ref = smooth["none"]
        seeds = [m for m in smooth if m.startswith("none_seed")]
        if seeds:  # the bf16 runs with other seeds: the band a gap must leave to mean anything
            gaps = [
                [100 * (a - b) / b for a, b in zip(smooth[m][1], ref, strict=True)] for m in seeds
            ]
            lo, hi = (list(map(fn, zip(*gaps, strict=True))) for fn in (min, max))
            axg.fill_between(steps, lo, hi, color="gray", alpha=0.3, label="bf16 other seeds")
        for mode, (s, y) in smooth.items():
            if mode != "none" and mode not in seeds:
                axg.plot(s, [100 * (a - b) / b for a, b in zip(y, ref, strict=True)], label=mode)
        axg.axhline(0, color="gray", lw=0.8)
        axg.set(xlabel="step", ylabel="train loss gap vs bf16 (%)", title="float8 - bf16")
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


def run_modes(runs: dict[str, list[str]], out: Path, jobs: int) -> None:
    """train.py once per run (name -> its flags), as child processes, at most ``jobs`` at a
    time; every line a run prints is prefixed with its name."""
    script = str(Path(__file__).resolve().parent / "train.py")
    pending = list(runs)
    running: dict[str, tuple[subprocess.Popen, threading.Thread]] = {}
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            cmd = [sys.executable, script, *runs[name], "--out", str(out / name), "--overwrite"]
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


# train.py's flags that compare.py sets per run
PER_RUN = ("float8", "out", "resume", "checkpoint_every", "overwrite", "memory")


def passthrough_help() -> str:
    """--help text for the train.py flags compare.py passes through."""
    tp = train.build_parser()
    fmt = tp._get_formatter()
    fmt.start_section("passed to train.py unchanged (train.py --help)")
    fmt.add_arguments(
        [a for a in tp._actions if a.option_strings and a.dest not in PER_RUN + ("help",)]
    )
    fmt.end_section()
    return fmt.format_help()


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = train._Parser(
        prog="compare.py",
        description=__doc__.split("\n")[0],
        epilog=passthrough_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # rowwise is opt-in: it is the slowest mode on CPU, and every mode is one more full run
    # of the demo (numbers/tiny.json has the per-mode tokens/s).
    p.add_argument(
        "--modes",
        default="none,tensorwise",
        help="comma-separated --float8 modes to run; 'none' is the bf16 reference",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default runs/compare_PRESET); a folder that holds a comparison "
        "is refused unless --overwrite",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the comparison in --out")
    p.add_argument(
        "--noise-seeds",
        type=int,
        default=2,
        help="extra bf16 runs with seeds seed+1 .. seed+N, for the noise band (0 = none)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="runs at a time (default 0 = one per CPU core on CPU, 1 on a GPU)",
    )
    args, train_argv = p.parse_known_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in train.FLOAT8_MODES]
    if bad or not modes:
        p.error(
            f"--modes: unknown mode(s) {','.join(bad) or '(none)'}; "
            f"choose from {','.join(train.FLOAT8_MODES)}"
        )
    for dest in PER_RUN:
        flag = "--" + dest.replace("_", "-")
        if any(a == flag or a.startswith(flag + "=") for a in train_argv):
            p.error(f"{flag} is set by compare.py per run; leave it out")
    if args.jobs < 0 or args.noise_seeds < 0:
        p.error("--jobs and --noise-seeds must be >= 0")
    base = train.parse_args(train_argv)  # validates the shared flags once, up front
    out = Path(args.out or f"runs/compare_{base.preset}")
    if (out / "summary.json").exists() or (out / "report.md").exists():
        if not args.overwrite:
            p.error(f"--out {out} already holds a comparison: pass --overwrite, or another --out")
    out.mkdir(parents=True, exist_ok=True)

    on_gpu = base.device == "cuda" or (base.device == "auto" and train.torch.cuda.is_available())
    jobs = args.jobs or (1 if on_gpu else os.cpu_count() or 1)
    # the seed flag goes last: argparse keeps the last value given
    extra = (
        [f"none_seed{base.seed + i}" for i in range(1, args.noise_seeds + 1)]
        if "none" in modes
        else []
    )
    runs_argv = {m: [*train_argv, "--float8", m] for m in modes}
    for name in extra:
        runs_argv[name] = [
            *train_argv,
            "--float8",
            "none",
            "--seed",
            name.removeprefix("none_seed"),
        ]

    t0 = time.perf_counter()
    run_modes(runs_argv, out, jobs)
    wall = time.perf_counter() - t0
    runs = {}
    for name in runs_argv:
        path = out / name / "metrics.jsonl"
        runs[name] = [json.loads(line) for line in path.read_text().splitlines()]

    summaries = {m: summarize(r) for m, r in runs.items()}
    noise = noise_band(summaries, extra)
    cfg = json.loads((out / modes[0] / "config.json").read_text())
    table = report_table(summaries, modes, noise)
    cmd = argv if argv is not None else sys.argv[1:]
    title = f"{base.preset}: {base.steps} steps, batch {base.batch_size} x {base.seq_len} bytes"
    data = cfg["data"]
    text = "\n".join(
        [
            f"# float8 vs bf16: {title}",
            "",
            table,
            "",
            f"- command: `python recipes/compare.py {' '.join(cmd)}`",
            f"- device: {cfg['device']}, torch {cfg['torch']}, float8kit {cfg['float8kit']}, "
            f"{cfg['n_params']:,} params, seed {base.seed}",
            f"- data: {data['source']} ({data['files']} files, {data['bytes']:,} bytes, "
            f"sha256 {data['sha256'][:16]})",
            f"- train loss = mean of the last {TRAIN_TAIL} steps; val loss = at the last step; "
            f"tokens/s = median after the first {WARMUP_STEPS} steps; wall time {wall:.0f} s",
            "- per-step numbers: MODE/metrics.jsonl; curves: loss.png",
            "",
        ]
    )
    (out / "report.md").write_text(text)
    summary = {"modes": modes, "summaries": summaries, "noise_runs": extra, "noise_pct": noise}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(runs, out / "loss.png", title)
    if plot_monitor(out, modes, out / "monitor.png"):  # train.py --monitor N was passed
        with (out / "report.md").open("a") as f:
            f.write("- per-layer SQNR (--monitor): MODE/monitor.jsonl; plot: monitor.png\n")
    print(f"\n{table}\n\nwrote {out / 'report.md'} and {out / 'loss.png'} ({wall:.0f} s)")
    return summaries


if __name__ == "__main__":
    main()
