"""The schedule as a Gantt chart, and loss curves (matplotlib is imported only when a chart is asked for)."""
from __future__ import annotations


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the charts need matplotlib: pip install matplotlib (or hydra-torch[plot])") from None

    if matplotlib.get_backend().lower() not in ("module://matplotlib_inline.backend_inline", "nbagg", "widget"):
        matplotlib.use("Agg")  # headless-safe unless a notebook backend is active
    import matplotlib.pyplot as plt

    return plt


def schedule_figure(results):
    plt = _pyplot()

    trace = results.trace
    # The host's steps get a row below the devices'; a step on a device is a thin bar under that device's row.
    rows = list(results.devices) + (["host steps"] if any(e.place == "host" for e in results.steps) else [])
    figure, axes = plt.subplots(figsize=(12, 1.0 + 0.6 * len(rows)))
    if not trace:
        axes.set_title("no units ran")
        return figure
    origin = min(e.start for e in trace)
    colours = plt.get_cmap("tab20")
    names = {}
    for e in trace:
        names.setdefault(e.task, e.task_name)
        hatch = {"backward": "//", "forward_backward": "xx", "evaluate": ".."}.get(e.phase)
        axes.barh(e.device, e.end - e.start, left=e.start - origin, height=0.8, color=colours(e.task % 20),
                  hatch=hatch, edgecolor="white", linewidth=0.2)
    for e in results.steps:
        names.setdefault(e.task, e.task_name)
        on_host = e.place == "host"
        axes.barh(len(results.devices) if on_host else e.device + 0.47, e.end - e.start, left=e.start - origin,
                  height=0.8 if on_host else 0.12, color=colours(e.task % 20), edgecolor="white" if on_host else "black",
                  linewidth=0.2)
    axes.set_yticks(range(len(rows)), rows)
    axes.invert_yaxis()
    axes.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(task % 20)) for task in sorted(names)]
    axes.legend(handles, [names[t] for t in sorted(names)], loc="upper left", bbox_to_anchor=(1.0, 1.0),
                fontsize="small", title="task (//: backward, ..: evaluation;\nthin: a step on the device)")
    utilisation = results.utilisation()
    axes.set_title("schedule — busy: " + ", ".join(f"{d} {100 * u:.0f}%" for d, u in utilisation.items()))
    figure.tight_layout()
    return figure


def curves_figure(results):
    """Training loss (thin) and validation loss (dots joined) per task against steps."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(9, 5))
    colours = plt.get_cmap("tab20")
    for i, task in enumerate(results.tasks):
        colour = colours(i % 20)
        if task.losses:
            axes.plot(range(1, len(task.losses) + 1), task.losses, color=colour, linewidth=0.8, alpha=0.5)
        if task.eval_losses:
            steps, losses = zip(*task.eval_losses)
            axes.plot(steps, losses, "o-", color=colour, markersize=3, label=task.name)
        else:
            axes.plot([], [], color=colour, label=task.name)
        if task.stopped and task.losses:
            axes.plot(len(task.losses), task.eval_losses[-1][1] if task.eval_losses else task.losses[-1], "x",
                      color=colour, markersize=8)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title("training (thin) and validation (dots) loss; x: stopped by the selection rule")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    figure.tight_layout()
    return figure
