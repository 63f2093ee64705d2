"""Bar chart of bench_gpu's CSV: forward and backward time of mokd (in-process
and through the daemon, when measured) next to the torch._grouped_mm baseline,
per shape, with the speed-up over the baseline written on each mokd bar.

usage: plot_bench.py bench_gpu.csv out.png
"""
import csv
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot_bench.py bench_gpu.csv out.png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_bench: matplotlib is not installed; the CSV has the figures")
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"plot_bench: {sys.argv[1]} has no rows")

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, phase in zip(axes, ("fwd", "bwd")):
        series = [("mokd", f"{phase}_ms", "#2b6cb0"),
                  ("via daemon", f"daemon_{phase}_ms", "#63b3ed"),
                  ("torch._grouped_mm", f"torch_{phase}_ms", "#a0aec0")]
        series = [s for s in series if any(float(r[s[1]]) > 0 for r in rows)]
        width = 0.8 / len(series)
        for j, (label, key, color) in enumerate(series):
            xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(rows))]
            ys = [float(r[key]) for r in rows]
            bars = ax.bar(xs, ys, width, label=label, color=color)
            if key == f"{phase}_ms":
                for b, r in zip(bars, rows):
                    ratio = float(r[f"ratio_{phase}"])
                    if ratio > 0:
                        ax.annotate(f"{ratio:.2f}x", (b.get_x() + b.get_width() / 2,
                                                      b.get_height()),
                                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["shape"] for r in rows])
        ax.set_ylabel("ms (lower is better)")
        ax.set_title("forward" if phase == "fwd" else "backward")
        ax.legend(fontsize=8)
    ceiling = rows[0].get("ceiling_tflops", "0")
    fig.suptitle(f"MoE layer, bf16; dense ceiling {ceiling} TFLOP/s (torch.matmul 8192^3)")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    print(f"plot_bench: wrote {sys.argv[2]}")


if __name__ == "__main__":
    main()
