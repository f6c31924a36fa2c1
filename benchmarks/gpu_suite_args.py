"""The GPU suite's command line (benchmarks/gpu_suite.py): its phases, the placements hydra trains P2 under, the steps
a model, and what each flag means."""
from __future__ import annotations

import argparse

DESCRIPTION = ("hydra-torch's GPU suite: hydra against plain PyTorch, DeepSpeed ZeRO-Offload (stage 2) and ZeRO-3 "
               "offload, and FSDP2 CPU offload on GPT-2-shaped models, under one GPU memory cap for every system.")
PHASES = ("p2", "p1", "stress", "p3")  # in the order they run: the figures that matter most first


def parse_phases(text: str) -> list[str]:
    phases = [p.strip().lower() for p in text.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        raise argparse.ArgumentTypeError(f"phases are a comma-separated subset of {','.join(PHASES)}, got {text!r}")
    return sorted(set(phases), key=PHASES.index)


def parse_placements(text: str) -> list[str]:
    placements = [p.strip().lower() for p in text.split(",") if p.strip()]
    if not placements or any(p not in ("auto", "host", "device") for p in placements) or \
            len(set(placements)) != len(placements):
        raise argparse.ArgumentTypeError(f"placements are distinct names of auto, host, device, got {text!r}")
    return placements


def parse_steps(text: str) -> tuple[int, int]:
    try:
        warmup, timed = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"steps are WARMUP,TIMED (two integers), got {text!r}") from None
    if warmup < 0 or timed < 1:
        raise argparse.ArgumentTypeError(f"steps need WARMUP >= 0 and TIMED >= 1, got {text!r}")
    return warmup, timed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--out", required=True, help="folder for gpu_suite.json and gpu_suite.md")
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU: every code path")
    p.add_argument("--phases", type=parse_phases, default=None,
                   help="which phases to run, e.g. p2 or p2,p1 (default p2,p1,stress; with --p3 or --smoke also p3)")
    p.add_argument("--p3", action="store_true", help="also search the largest model hydra trains under the cap")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-time box for the whole run (default 330, smoke 50)")
    p.add_argument("--cap-gib", type=float, default=16.0, help="GPU memory cap for every system (capped runs)")
    p.add_argument("--p2-max-models", type=int, default=None, help="upper bound on K (time box); RAM sets the rest")
    p.add_argument("--hydra-placements", type=parse_placements, default=["auto"],
                   help="P2 trains hydra once per placement (ht.train's placement), e.g. auto,host; the first is "
                        "recorded as 'hydra', the others as 'hydra_<placement>'")
    p.add_argument("--p2-steps", type=parse_steps, default=None,
                   help="hydra's steps a model in P2 as WARMUP,TIMED (default 2,4): more give a steadier window")
    p.add_argument("--skip-baselines", action="store_true", help="P2 runs hydra alone (no DeepSpeed or FSDP2)")
    args = p.parse_args(argv)
    if args.phases is None:
        args.phases = list(PHASES) if (args.p3 or args.smoke) else [q for q in PHASES if q != "p3"]
    return args
