"""The GPU suite's markdown summary, written from its JSON record."""
from __future__ import annotations


def _num(value, fmt="{:.0f}"):
    return fmt.format(value) if isinstance(value, (int, float)) and value is not None else "-"


def _status(result: dict) -> str:
    if "skipped" in result:
        return f"skipped: {result['skipped']}"
    if "error" in result:
        return f"failed: {result['error'][:200]}"
    return "ok"


def _row(name: str, r: dict) -> str:
    busy = r.get("utilisation", r.get("cuda_event_busy_fraction"))
    moved = (r.get("host_to_device_bytes") or 0) + (r.get("device_to_host_bytes") or 0)
    return (f"| {name} | {_num(r.get('tokens_per_s'))} | {_num(r.get('end_to_end_tokens_per_s'))} "
            f"| {_num(r.get('wall_s'), '{:.1f}')} | {_num(r.get('peak_gpu_gib'), '{:.2f}')} "
            f"| {_num(r.get('peak_host_rss_gib'), '{:.1f}')} | {_num(busy, '{:.2f}')} "
            f"| {_num(r.get('nvml_gpu_util_mean'), '{:.2f}')} | {_num(moved / 1e9 if moved else None, '{:.1f}')} "
            f"| {_num(r.get('copy_gbps_over_wall'), '{:.1f}')} | {_status(r)} |")


HEADER = ("| system | tokens/s (median step) | tokens/s (end to end) | wall s | peak GPU GiB | peak host RSS GiB "
          "| busy (hydra trace / CUDA events) | NVML util | GB copied | copy GB/s over wall | status |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def _profile(p: dict) -> list[str]:
    lines = ["## Profile of one spilled step (P1's model, smallest batch, under the cap)", ""]
    if "error" in p or "skipped" in p:
        return lines + [_status(p), ""]
    gpu = p.get("gpu", {})
    s = lambda v: _num(v, "{:.3f}")  # noqa: E731
    lines += [f"{p['shards']} shards, step {p['steps']} of {p['steps']} profiled; resident: {p['resident']}.", "",
              "| where | seconds per step |", "|---|---|",
              f"| step wall (first unit start to last unit end) | {s(p.get('step_wall_s'))} |",
              f"| sum of unit wall times | {s(p.get('unit_seconds_sum'))} |"]
    for phase, v in p.get("by_phase", {}).items():
        lines.append(f"| units: {phase} ({v['units']}) | {s(v['seconds'])} |")
    lines += [f"| GPU kernels (union) | {s(gpu.get('kernel_s'))} |",
              f"| GPU copies host-to-device / device-to-host | {s(gpu.get('h2d_s'))} / {s(gpu.get('d2h_s'))} |",
              f"| copies running under kernels | {s(gpu.get('copy_under_kernels_s'))} |",
              f"| GPU idle (no kernel, no copy) in the window | {s(gpu.get('gpu_idle_s'))} |",
              f"| host jobs: accumulation + optimizer steps (host-step threads) | {s(p.get('host_step_seconds_per_step'))} |",
              f"| issuing gradient / weight copies (copy lanes) | {s(p.get('grad_copy_seconds_per_step'))} / "
              f"{s(p.get('weight_copy_seconds_per_step'))} |",
              f"| GB copied host-to-device / device-to-host | {_num(p.get('host_to_device_gb_per_step'), '{:.2f}')} / "
              f"{_num(p.get('device_to_host_gb_per_step'), '{:.2f}')} |", ""]
    return lines


def _p2(p2: dict) -> list[str]:
    w = p2["workload"]
    lines = [f"## P2, K = {p2['k']} models of {w['params'] / 1e9:.2f}B params, batch {w['batch']} x {w['seq']}", "",
             f"{p2['k_reason']} (limit {p2['k_limit']}). " + p2.get("skipped", ""), ""]
    if "hydra" not in p2:
        return lines
    hydra = p2["hydra"]
    ratios = ", ".join(f"vs {name[len('ratio_hydra_vs_'):]} {value:.2f}x" for name, value in p2.items()
                       if name.startswith("ratio_hydra_vs_"))
    lines += [f"Cap {p2['cap_gib']:.1f} GiB, hydra budget {p2['hydra_budget_gib']:.1f} GiB ({p2['budget_note']}). "
              f"hydra over its steady window (every model past warm-up until the last step): "
              f"{_num(hydra.get('window_tokens_per_s'))} tokens/s; {ratios or 'no ratio'}. Over every step's span "
              f"{_num(hydra.get('span_tokens_per_s'))} tokens/s, NVML utilisation "
              f"{_num(hydra.get('nvml_gpu_util_span'), '{:.2f}')} over it. Baselines: one model, "
              f"{p2['baseline_workload']['warmup'] + p2['baseline_workload']['timed']} steps (K one after another train at that rate); "
              f"best baseline {p2.get('best_baseline', '-')} also as K processes at once under cap / K.", "", HEADER]
    for name, r in p2.items():
        if isinstance(r, dict) and name not in ("workload", "baseline_workload"):
            lines.append(_row(name, r))
    return lines + [""]


def _stress(r: dict) -> list[str]:
    lines = ["## Stream stress: 3 small spilled GPT-2 models, the device run against the CPU run", "", _status(r), ""]
    if any(p in r for p in ("fp32", "bf16")):
        lines += ["| precision | largest error (of an update) | where | threshold | fewest loads of a shard "
                  "| device s | CPU s |", "|---|---|---|---|---|---|---|"]
        for precision in ("fp32", "bf16"):
            p = r.get(precision)
            if p:
                loads = min(min(shards) for shards in p["shard_loads"])
                lines.append(f"| {precision} | {p['largest_error']:.3g} | {p['where'] or '-'} | {p['threshold']} "
                             f"| {loads} | {p['device_seconds']:.1f} | {p['cpu_seconds']:.1f} |")
        lines.append("")
    return lines


def markdown(record: dict) -> str:
    m = record.get("machine", {})
    lines = [f"# hydra-torch GPU suite ({record['mode']}, {record['device']})", "",
             f"- GPU: {m.get('nvidia_smi_L') or '-'}",
             f"- host RAM: {_num((m.get('host_ram', {}).get('total_bytes') or 0) / 2**30, '{:.0f}')} GiB, "
             f"{m.get('cpu_count')} CPUs ({m.get('cpu')})",
             f"- python {m.get('python')}, torch {m.get('torch')} (CUDA {m.get('torch_cuda')}), "
             + ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items()),
             f"- PCIe (pinned, 1 GiB): {record.get('pcie')}",
             f"- wall time {_num(record.get('wall_s'), '{:.0f}')} s; failures: {record.get('failures') or 'none'}", ""]
    phases = record.get("phases", {})
    p2 = phases.get("P2")
    if p2:
        lines += _p2(p2)
    for key, entry in phases.get("P1", {}).items():
        if not key.startswith("batch_"):
            continue
        w = entry["workload"]
        lines += [f"## P1, batch {w['batch']} x {w['seq']} = {w['tokens_per_step']} tokens, "
                  f"{w['params'] / 1e9:.2f}B params", "",
                  f"hydra budget {entry['hydra_budget_gib']:.1f} GiB under a cap of {entry['cap_gib']:.1f} GiB "
                  f"({entry['budget_note']}). Ratios: spilled / plain with activation checkpointing (same FLOPs) "
                  f"{_num(entry.get('ratio_spilled_vs_plain_checkpointed'), '{:.2f}')}, spilled / plain "
                  f"{_num(entry.get('ratio_spilled_vs_plain'), '{:.2f}')}, resident / plain "
                  f"{_num(entry.get('ratio_resident_vs_plain'), '{:.2f}')}. " + entry.get("warning", ""), "", HEADER]
        lines += [_row(name, r) for name, r in entry.items() if isinstance(r, dict) and name != "workload"]
        lines.append("")
    profile = phases.get("P1", {}).get("profile_spilled_step")
    if profile:
        lines += _profile(profile)
    stress = phases.get("stress", {}).get("stream_stress")
    if stress:
        lines += _stress(stress)
    p3 = phases.get("P3")
    if p3:
        lines += ["## P3, largest model under the cap (3 steps)", "",
                  f"largest AdamW: {_num((p3.get('largest_adamw_params') or 0) / 1e9, '{:.2f}')}B params; "
                  f"largest SGD: {_num((p3.get('largest_sgd_params') or 0) / 1e9, '{:.2f}')}B params", "",
                  "| optimizer | n_layer | params | cap GiB | peak GPU GiB | tokens/s | status |", "|---|---|---|---|---|---|---|"]
        for a in p3["attempts"]:
            lines.append(f"| {a['optimizer']} | {a['n_layer']} | {a['params'] / 1e9:.2f}B | {_num(a.get('cap_gib'), '{:.1f}')} "
                         f"| {_num(a.get('peak_gpu_gib'), '{:.2f}')} | {_num(a.get('tokens_per_s'))} | {_status(a)} |")
        lines.append("")
    return "\n".join(lines) + "\n"
