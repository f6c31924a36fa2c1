"""The GPU suite's shared pieces: the workload, the machine record, PCIe bandwidth, host-memory arithmetic and
a sampler of host RSS and GPU utilisation while a system trains."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from importlib import metadata

import torch

GiB = 2**30


@dataclass
class Workload:
    """What every system trains: GPT-2-shaped models, random tokens, the same steps and seed."""
    n_embd: int
    n_layer: int
    n_head: int
    vocab: int = 50257
    seq: int = 1024
    batch: int = 4
    warmup: int = 2          # steps left out of the timing (allocator growth, kernel selection, JIT)
    timed: int = 4
    seed: int = 0

    @property
    def steps(self) -> int:
        return self.warmup + self.timed

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq

    def params(self) -> int:
        """GPT-2's parameter count with the LM head tied to the token embedding."""
        d, L = self.n_embd, self.n_layer
        per_layer = 12 * d * d + 13 * d      # attention (4 d^2 + 4 d), MLP (8 d^2 + 5 d), two LayerNorms (4 d)
        return self.vocab * d + self.seq * d + L * per_layer + 2 * d

    def as_dict(self) -> dict:
        return {**asdict(self), "params": self.params(), "tokens_per_step": self.tokens_per_step}


def build_model(w: Workload, seed: int, dtype=torch.float32, init_device: str = "cpu"):
    """A randomly initialised GPT2LMHeadModel of the workload's shape (no hub), in host memory. Every run builds
    its own from the seed: initialised on `init_device` (a GPU draws GPT-2 XL's 1.56B numbers in well under a
    second, the host in ~15 s) and moved to the host, so every system of a phase starts from the same weights
    that a run on the same kind of device drew. Dropout is off so every system does the same arithmetic per
    step and none pays for random masks the others skip; the GELU is `gelu_pytorch_tanh`, the same formula as
    GPT-2's `gelu_new` in one kernel instead of eight, in every system alike."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=w.vocab, n_positions=w.seq, n_embd=w.n_embd, n_layer=w.n_layer,
                        n_head=w.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        activation_function="gelu_pytorch_tanh", bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    if init_device.startswith("cuda"):
        torch.cuda.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)   # P3 builds in bf16 directly: a 6B model's fp32 copy would not fit beside it
    try:
        with torch.device(init_device):
            model = GPT2LMHeadModel(config)
        return model.to("cpu")
    finally:
        torch.set_default_dtype(previous)


def make_batches(w: Workload) -> list[dict]:
    g = torch.Generator().manual_seed(w.seed)
    out = []
    for _ in range(w.steps):
        ids = torch.randint(0, w.vocab, (w.batch, w.seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def median_after(times: list[float], warmup: int) -> float | None:
    timed = times[warmup:] or times[-1:]
    return statistics.median(timed) if timed else None


# ---- host memory ----------------------------------------------------------------------------------------

def meminfo() -> dict:
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, rest = line.split(":", 1)
                values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return {"total_bytes": values.get("MemTotal"), "available_bytes": values.get("MemAvailable")}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def hydra_host_bytes_per_param(w: Workload, optimizer_states: int, module_bytes: int = 4) -> float:
    """Host bytes per parameter while hydra trains a GPT-2 shape in bf16 with one micro-batch a step and no
    clipping (TaskResult.host_bytes): fp32 master 4 + 4 per optimizer state (AdamW 2, plain SGD 0) + bf16
    shadow 2, an fp32 gradient accumulator (4) for the tied embedding's shard only, plus the user's own module
    tensors (4 in fp32, 2 in bf16). AdamW with an fp32 module: 18 + 4 x the embedding's share."""
    tied_share = w.vocab * w.n_embd / w.params()
    return 4 + 4 * optimizer_states + 2 + 4 * tied_share + module_bytes


def models_that_fit(params_per_model: int, bytes_per_param: float, headroom: float = 0.25) -> tuple[int, str]:
    """How many models' host state fits in the RAM available now, leaving `headroom` of it free."""
    available = meminfo()["available_bytes"] or 0
    usable = int((1 - headroom) * available)
    per_model = params_per_model * bytes_per_param
    k = int(usable // per_model) if per_model else 0
    why = (f"K = floor({1 - headroom:.2f} x {available / GiB:.1f} GiB available / ({params_per_model / 1e6:.0f}M params"
           f" x {bytes_per_param:.1f} B/param = {per_model / GiB:.1f} GiB per model)) = {k}")
    return int(k), why


class Sampler:
    """Samples this process's RSS (peak) and, on CUDA with NVML, the GPU's utilisation (mean) while it runs."""

    def __init__(self, device: torch.device, period: float = 0.05):
        self.device, self.period = device, period
        self.peak_rss, self.nvml_error = rss_bytes(), None
        self.util: list[tuple[float, float]] = []  # (perf_counter seconds, utilisation in percent)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        nvml = self.device.type == "cuda"
        while not self._stop.wait(self.period):
            self.peak_rss = max(self.peak_rss, rss_bytes())
            if nvml:
                try:
                    self.util.append((time.perf_counter(), torch.cuda.utilization(self.device)))
                except Exception as error:  # no pynvml, or NVML refused: the other measures still stand
                    self.nvml_error, nvml = f"{type(error).__name__}: {error}", False

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_rss = max(self.peak_rss, rss_bytes())

    def util_between(self, begin: float, end: float) -> float | None:
        """NVML's mean utilisation (0-1) over the samples taken from `begin` to `end` (perf_counter seconds): the
        training alone, without the setup that the whole run's mean includes."""
        inside = [util for t, util in self.util if begin <= t <= end]
        return statistics.mean(inside) / 100 if inside else None

    def record(self) -> dict:
        return {"peak_host_rss_gib": self.peak_rss / GiB,
                "nvml_gpu_util_mean": (statistics.mean(u for _, u in self.util) / 100 if self.util else None),
                **({"nvml_error": self.nvml_error} if self.nvml_error else {})}


# ---- the machine ----------------------------------------------------------------------------------------

def _version(name: str) -> str | None:
    try:
        return metadata.version(name)   # reads metadata only: DeepSpeed is not imported here
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as error:
        smi = f"unavailable: {error}"
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    record = {"nvidia_smi_L": smi, "host_ram": meminfo(), "cpu": cpu, "cpu_count": os.cpu_count(),
              "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
              "cuda_available": torch.cuda.is_available(),
              "versions": {n: _version(n) for n in ("transformers", "deepspeed", "hydra-torch", "pydantic", "ninja")}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        record["gpu"] = {"name": props.name, "total_memory_gib": props.total_memory / GiB}
    return record


def pcie_bandwidth(device: torch.device, nbytes: int = GiB, repeats: int = 3) -> dict:
    """Pinned host <-> device copy of `nbytes` each way, the median of `repeats` after one warm-up copy."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA: host-device copies only exist with a GPU"}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {"bytes": nbytes}
    for name, dst, src in (("host_to_device_gbps", dev, host), ("device_to_host_gbps", host, dev)):
        seconds = []
        for i in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i:
                seconds.append(start.elapsed_time(end) / 1e3)
        out[name] = nbytes / statistics.median(seconds) / 1e9
    del host, dev
    torch.cuda.empty_cache()
    return out
