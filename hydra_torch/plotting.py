"""The schedule as a Gantt chart (matplotlib is imported only when a chart is asked for)."""
from __future__ import annotations


def schedule_figure(results):
    import matplotlib

    if matplotlib.get_backend().lower() not in ("module://matplotlib_inline.backend_inline", "nbagg", "widget"):
        matplotlib.use("Agg")  # headless-safe unless a notebook backend is active
    import matplotlib.pyplot as plt

    trace = results.trace
    figure, axes = plt.subplots(figsize=(12, 1.0 + 0.6 * len(results.devices)))
    if not trace:
        axes.set_title("no units ran")
        return figure
    origin = min(e.start for e in trace)
    colours = plt.get_cmap("tab20")
    names = {}
    for e in trace:
        names.setdefault(e.task, e.task_name)
        hatch = "//" if e.phase == "backward" else ("xx" if e.phase == "forward_backward" else None)
        axes.barh(e.device, e.end - e.start, left=e.start - origin, height=0.8, color=colours(e.task % 20),
                  hatch=hatch, edgecolor="white", linewidth=0.2)
    axes.set_yticks(range(len(results.devices)), results.devices)
    axes.invert_yaxis()
    axes.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(task % 20)) for task in sorted(names)]
    axes.legend(handles, [names[t] for t in sorted(names)], loc="upper left", bbox_to_anchor=(1.0, 1.0),
                fontsize="small", title="task (hatched: backward)")
    utilisation = results.utilisation()
    axes.set_title("schedule — busy: " + ", ".join(f"{d} {100 * u:.0f}%" for d, u in utilisation.items()))
    figure.tight_layout()
    return figure
