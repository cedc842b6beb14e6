"""PNG timelines: CPU and the three GPU streams as lanes, one panel per mode."""
from __future__ import annotations

from slipstream.core.tracing import LANES, Timeline

COLORS = {"schedule": "#4c72b0", "launch": "#55a868", "wait": "#dddddd", "process": "#c44e52",
          "h2d": "#8172b2", "compute": "#ccb974", "d2h": "#64b5cd"}


def steady_window(timeline: Timeline, num_batches: int = 8) -> tuple[float, float]:
    """A window of `num_batches` compute spans from the middle of the run."""
    compute = sorted((s for s in timeline.spans if s.lane == "compute"), key=lambda s: s.start)
    if len(compute) <= num_batches:
        return timeline.bounds()
    mid = len(compute) // 2
    return compute[mid].start, compute[mid + num_batches].start


def plot_timelines(timelines: dict[str, Timeline], path: str, title: str = "",
                   num_batches: int = 8) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.6 + 1.4 * len(timelines)), squeeze=False)
    for ax, (label, tl) in zip(axes[:, 0], timelines.items()):
        lo, hi = steady_window(tl, num_batches)
        for lane_idx, lane in enumerate(LANES):
            y = len(LANES) - 1 - lane_idx
            for s in tl.spans:
                if s.lane != lane or s.end < lo or s.start > hi:
                    continue
                a, b = max(s.start, lo), min(s.end, hi)
                ax.broken_barh([((a - lo) * 1e3, (b - a) * 1e3)], (y - 0.4, 0.8),
                               facecolors=COLORS.get(s.name, "#999999"), edgecolors="white", linewidth=0.6)
        active = tl.gpu_active(lo, hi)
        ax.set_yticks(range(len(LANES)))
        ax.set_yticklabels(list(reversed(LANES)))
        ax.set_xlim(0, (hi - lo) * 1e3)
        ax.set_title(f"{label}: GPU active {100 * active:.1f}% in this window", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("ms")
    handles = [matplotlib.patches.Patch(color=c, label=n) for n, c in COLORS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=len(COLORS), fontsize=8)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
