"""The GPU suite's baselines, one function each, as gpu_suite_systems.py's systems (the same batches, AdamW with
weight decay 0.01, a dict of measurements, "error" or "skipped"): DeepSpeed ZeRO-Offload and ZeRO-3 offload, and
FSDP2 with or without CPU offload, each in a one-process group. DeepSpeed and FSDP are imported inside their
functions only."""
from __future__ import annotations

import os
import socket

import torch

from gpu_suite_env import Workload
from gpu_suite_systems import WEIGHT_DECAY, _reset, _sequential, checkpoint_activations, failure


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group(device: torch.device):
    """A one-process group (world size 1) for FSDP2 and DeepSpeed, which expect torch.distributed."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # CPU tensors (DeepSpeed's bookkeeping) go through gloo, CUDA tensors through NCCL.
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def import_check(module: str) -> str:
    try:
        imported = __import__(module)
        return f"importable ({module} {getattr(imported, '__version__', '?')})"
    except Exception as error:  # ImportError, or a package that fails while importing
        return f"not importable: {type(error).__name__}: {error}"


def zero_config(stage: int) -> dict:
    """ZeRO-Offload proper (stage 2): bf16 parameters stay on the device, the fp32 masters and AdamW on pinned
    CPU memory (DeepSpeedCPUAdam). Stage 3 also offloads the parameters, fetched to the device layer by layer."""
    config = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
              "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        config["offload_param"] = {"device": "cpu", "pin_memory": True}
    return config


def run_deepspeed(models, lrs, w: Workload, data, device: torch.device, deadline=None, stage=3, report=None) -> dict:
    """DeepSpeed ZeRO-Offload (`stage` 2) or ZeRO-3 offload (`stage` 3, parameters offloaded too): optimizer state
    on pinned CPU memory (DeepSpeedCPUAdam), bf16 weights with fp32 masters, activation checkpointing per block;
    one model at a time."""
    if device.type != "cuda":
        return {"skipped": f"needs CUDA: ZeRO stage {stage} offload runs its CPU Adam op for the CUDA accelerator"
                           + (" and fetches partitioned parameters onto a CUDA device" if stage == 3 else ""),
                "import": import_check("deepspeed")}
    try:
        import deepspeed

        ensure_process_group(device)

        def setup(model, lr):
            config = {
                "train_micro_batch_size_per_gpu": w.batch, "gradient_accumulation_steps": 1,
                "steps_per_print": 10**9, "wall_clock_breakdown": False,
                "bf16": {"enabled": True},
                "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                           "weight_decay": WEIGHT_DECAY}},
                "zero_optimization": zero_config(stage),
            }
            model.train()
            checkpointing = checkpoint_activations(model)
            engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=config)

            def forward_backward(batch):
                engine.backward(engine(**batch).loss)

            def teardown():
                nonlocal engine, optimizer
                if hasattr(engine, "destroy"):  # releases its hooks and pinned buffers before the next model
                    engine.destroy()
                engine, optimizer = None, None
            return forward_backward, engine.step, teardown, {"optimizer_class": type(optimizer).__name__,
                                                             "deepspeed": deepspeed.__version__, **checkpointing}

        return _sequential(w, models, lrs, data, device, deadline, setup, report)
    except Exception as error:
        return failure(error)
    finally:
        _reset(device)


def run_fsdp2(models, lrs, w: Workload, data, device: torch.device, deadline=None, offload=True, report=None) -> dict:
    """FSDP2 (`fully_shard` per transformer block and at the root) at world size 1 with
    CPUOffloadPolicy(pin_memory=True): sharded fp32 parameters, gradients and AdamW on the host, bf16 compute
    (MixedPrecisionPolicy), activation checkpointing per block; one model at a time. offload=False is the CPU
    smoke test's code-path check."""
    if offload and device.type != "cuda":
        return {"skipped": "needs CUDA: CPUOffloadPolicy moves parameters between host and a CUDA device",
                "import": import_check("torch.distributed.fsdp")}
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        ensure_process_group(device)

        def setup(model, lr):
            checkpointing = checkpoint_activations(model)
            policy = CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()
            mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.transformer.h:
                fully_shard(block, mp_policy=mixed, offload_policy=policy)
            fully_shard(model, mp_policy=mixed, offload_policy=policy)  # embeddings, tied head, final norm
            model.train()
            # The fused CPU kernel is torch's fastest AdamW; if it refuses the sharded (DTensor) parameters,
            # the default (foreach) one is used and the record says so.
            state = {"opt": torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, fused=True),
                     "fused": True}

            def forward_backward(batch):
                model(**batch).loss.backward()

            def step():
                try:
                    state["opt"].step()
                except (RuntimeError, NotImplementedError):
                    if not state["fused"]:
                        raise
                    state["opt"] = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
                    state["fused"] = False
                    state["opt"].step()
                state["opt"].zero_grad(set_to_none=True)

            def teardown():
                nonlocal model
                model = None
                state.pop("opt", None)
            return forward_backward, step, teardown, {"offload": offload, "fused_adamw": lambda: state.get("fused"),
                                                      **checkpointing}

        out = _sequential(w, models, lrs, data, device, deadline, setup, report)
        out.update({k: v() for k, v in out.items() if callable(v)})
        return out
    except Exception as error:
        return failure(error)
    finally:
        _reset(device)
