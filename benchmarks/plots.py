"""The pictures the benchmark scripts draw for the docs (`--plot`): small PNGs of
held-out accuracy against training time, and of throughput against model size.
matplotlib is imported only when a picture is drawn."""

from __future__ import annotations

from pathlib import Path

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
SIZE = {"figsize": (7.0, 3.5), "dpi": 80, "layout": "constrained"}


def accuracy_curves(
    runs: dict[str, list[list[dict]]],
    path: Path,
    title: str,
    ylabel: str = "held-out accuracy",
    budget: float | None = None,
    minutes: bool = False,
) -> None:
    """Draws held-out accuracy against training time into `path`: a colour per name
    (rlray, TRL, a variant), a line per run. A run is its list of evaluations, each a
    dict with "seconds" (of training) and "accuracy"; those past `budget` are left out."""
    from matplotlib.figure import Figure

    figure = Figure(**SIZE)
    axes = figure.subplots()
    scale = 60.0 if minutes else 1.0
    for (name, evaluations), color in zip(runs.items(), COLORS, strict=False):
        for i, evals in enumerate(evaluations):
            shown = [e for e in evals if budget is None or e["seconds"] <= budget]
            x = [e["seconds"] / scale for e in shown]
            y = [e["accuracy"] for e in shown]
            label = name if i == 0 else None
            axes.plot(x, y, marker="o", markersize=3, color=color, label=label)
    unit = "minutes" if minutes else "seconds"
    axes.set_xlabel(f"training {unit} (held-out evaluations not counted)")
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    axes.set_ylim(0, 1)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="lower right")
    save(figure, path)


def throughput_by_size(lines: dict[str, list[tuple[float, float]]], path: Path, title: str) -> None:
    """Draws episodes/s against model parameters (both axes logarithmic) into `path`: a
    line per system, each point (parameters, episodes/s)."""
    from matplotlib.figure import Figure

    figure = Figure(**SIZE)
    axes = figure.subplots()
    for (name, points), color in zip(lines.items(), COLORS, strict=False):
        points = sorted(points)
        axes.plot(*zip(*points, strict=True), marker="o", color=color, label=name)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("model parameters")
    axes.set_ylabel("episodes/s")
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="upper right")
    save(figure, path)


def save(figure, path: Path) -> None:
    """Writes the figure and says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    print(f"picture: {path}", flush=True)
