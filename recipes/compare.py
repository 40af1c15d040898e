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
every number in the report can be recomputed from them:

- train loss: mean of the last 10 logged training losses (one batch is noisy);
- val loss: the val_loss logged at the last step (fixed validation windows, same for all);
- gap: (mode - bf16) / bf16 in %;
- tokens/s: median over the steps after the first 3 (those include warm-up and compile);
- speedup: tokens/s over the bf16 run's tokens/s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
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


def report_table(summaries: dict[str, dict]) -> str:
    ref = summaries.get("none")
    rows = [
        "| mode | train loss | val loss | train gap vs bf16 | val gap vs bf16 | tokens/s "
        "| speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, s in summaries.items():
        name = "none (bf16)" if mode == "none" else mode
        tg = gap(s["train_loss"], ref["train_loss"]) if ref else "n/a"
        vg = gap(s["val_loss"], ref["val_loss"]) if ref else "n/a"
        sp = f"{s['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "n/a"
        rows.append(
            f"| {name} | {s['train_loss']:.4f} | {s['val_loss']:.4f} | {tg} | {vg} "
            f"| {s['tokens_per_s']:.0f} | {sp} |"
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
        for mode, (s, y) in smooth.items():
            if mode != "none":
                axg.plot(s, [100 * (a - b) / b for a, b in zip(y, ref, strict=True)], label=mode)
        axg.axhline(0, color="gray", lw=0.8)
        axg.set(xlabel="step", ylabel="train loss gap vs bf16 (%)", title="float8 - bf16")
        axg.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_modes(modes: list[str], train_argv: list[str], out: Path, jobs: int) -> None:
    """train.py once per mode, as child processes, at most ``jobs`` at a time."""
    script = str(Path(__file__).resolve().parent / "train.py")
    pending = list(modes)
    running: dict[str, subprocess.Popen] = {}
    while pending or running:
        while pending and len(running) < jobs:
            mode = pending.pop(0)
            cmd = [sys.executable, script, *train_argv, "--float8", mode, "--out", str(out / mode)]
            running[mode] = subprocess.Popen(cmd)
        time.sleep(0.2)
        for mode, proc in list(running.items()):
            if proc.poll() is None:
                continue
            del running[mode]
            if proc.returncode:
                for other in running.values():
                    other.terminate()
                sys.exit(f"compare.py: the --float8 {mode} run failed (exit {proc.returncode})")


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = train._Parser(prog="compare.py", description=__doc__.split("\n")[0])
    # rowwise is opt-in: it is the slowest mode on CPU, and every mode is one more full run
    # of the demo (numbers/tiny.json has the per-mode tokens/s).
    p.add_argument(
        "--modes",
        default="none,tensorwise",
        help="comma-separated --float8 modes to run; 'none' is the bf16 reference",
    )
    p.add_argument("--out", default=None, help="output folder (default runs/compare_PRESET)")
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
    for flag in ("--float8", "--out", "--resume", "--checkpoint-every"):
        if any(a == flag or a.startswith(flag + "=") for a in train_argv):
            p.error(f"{flag} is set by compare.py per run; leave it out")
    base = train.parse_args(train_argv)  # validates the shared flags once, up front
    out = Path(args.out or f"runs/compare_{base.preset}")
    out.mkdir(parents=True, exist_ok=True)

    if args.jobs < 0:
        p.error("--jobs must be >= 0")
    on_gpu = base.device == "cuda" or (base.device == "auto" and train.torch.cuda.is_available())
    jobs = args.jobs or (1 if on_gpu else os.cpu_count() or 1)

    t0 = time.perf_counter()
    run_modes(modes, train_argv, out, jobs)
    wall = time.perf_counter() - t0
    runs = {}
    for mode in modes:
        path = out / mode / "metrics.jsonl"
        runs[mode] = [json.loads(line) for line in path.read_text().splitlines()]

    summaries = {m: summarize(r) for m, r in runs.items()}
    cfg = json.loads((out / modes[0] / "config.json").read_text())
    table = report_table(summaries)
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
    plot(runs, out / "loss.png", title)
    print(f"\n{table}\n\nwrote {out / 'report.md'} and {out / 'loss.png'} ({wall:.0f} s)")
    return summaries


if __name__ == "__main__":
    main()
