"""Plots of a simulation (matplotlib: the 'plot' extra)."""

from __future__ import annotations

from typing import Any

from pitstop.errors import MissingExtraError
from pitstop.policy import daly_optimum
from pitstop.sim.compare import PolicySummary
from pitstop.sim.model import JobModel

__all__ = ["plot_report"]


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtraError("plots need matplotlib: pip install 'pitstop[plot]'") from None
    return plt


def plot_report(
    path: str,
    summaries: list[PolicySummary],
    sweep: list[tuple[float, float, float]],
    *,
    job: JobModel,
    mtbf_secs: float,
) -> None:
    """Goodput per policy; a timeline of progress, checkpoints and failures; overhead vs interval."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    names = [s.name for s in summaries]
    good = [s.mean(lambda r: r.goodput) for s in summaries]
    err = [s.std(lambda r: r.goodput) for s in summaries]
    ax = axes[0]
    ax.bar(range(len(names)), good, yerr=err, color="tab:blue", capsize=4)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylim(min(good) * 0.95 if good else 0, 1.0)
    ax.set_ylabel("goodput (useful compute / wall clock)")
    ax.set_title("goodput per policy (mean ± sd over seeds)")

    ax = axes[1]
    for s in summaries:
        run = s.runs[0]
        points = [(0.0, 0.0)]
        for t, kind, progress in run.events:
            if kind == "failure":
                points.append((t / 3600, progress / 3600))
                points.append((t / 3600, float("nan")))
            elif kind == "commit":
                points.append((t / 3600, progress / 3600))
        ts = [p[0] for p in points] + [run.wall_secs / 3600]
        ps = [p[1] for p in points] + [run.work_secs / 3600]
        (line,) = ax.plot(ts, ps, lw=1, label=s.name)
        fails = [e for e in run.events if e[1] == "failure"]
        ax.scatter(
            [e[0] / 3600 for e in fails],
            [e[2] / 3600 for e in fails],
            marker="x",
            s=14,
            color=line.get_color(),
        )
    ax.set_xlabel("wall clock (h)")
    ax.set_ylabel("committed progress (compute h)")
    ax.set_title("timeline, seed 0 (x: failures)")
    ax.legend(fontsize=8)

    ax = axes[2]
    xs = [p[0] for p in sweep]
    ax.errorbar(
        xs,
        [100 * p[1] for p in sweep],
        yerr=[100 * p[2] for p in sweep],
        marker="o",
        capsize=3,
        label="EveryN, simulated",
    )
    cost = max(job.stall_secs + job.slowdown_secs, 1e-9)
    opt = daly_optimum(cost, mtbf_secs)
    ax.axvline(opt, color="tab:red", ls="--", label=f"Daly optimum {opt:.0f} s")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (s of compute)")
    ax.set_ylabel("overhead (% of wall clock)")
    ax.set_title("overhead vs interval")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
