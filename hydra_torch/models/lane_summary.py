"""What the lane model was told and forecast (Results.lane_plan, Plan.lane_plan), in one line of text."""
from __future__ import annotations

from hydra_torch.models.memory import format_bytes


def describe(lane_plan: dict) -> str:
    """The lanes' measured rates and the forecast busy share of each."""
    rates, busy = lane_plan["rates"], lane_plan["busy"]
    return (f"lane model: link {_rate(rates['copies_in'])} in, {_rate(rates['copies_out'])} out, steps "
            f"{_rate(rates['host_steps'])} on the host, {_rate(rates['device_steps'])} on the device; "
            f"forecast busy: compute {100 * busy['compute']:.0f}%, copies in {100 * busy['copies_in']:.0f}%, out "
            f"{100 * busy['copies_out']:.0f}%, host {100 * busy['host']:.0f}%")


def _rate(bytes_per_second: float) -> str:
    return f"{format_bytes(int(bytes_per_second))}/s"
