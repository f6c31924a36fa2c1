"""torch.ops.hydra.adam_step / sgd_step: op registration, agreement with torch.optim, argument checks."""
import pytest
import torch

import hydra_torch  # noqa: F401  (loads the native library and registers the ops)
from hydra_torch import ops

# Bigger than one parallel slice (2**17 elements) and not a multiple of any vector width, so the
# threaded split and the scalar tails are both exercised.
N = 300_007
STEPS = 20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _adam_args(n=64, grad_dtype=torch.float32, shadow=True, device="cpu", decoupled=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen)
    args = (param, torch.randn(n, generator=gen).to(grad_dtype), torch.randn(n, generator=gen) * 0.1,
            torch.rand(n, generator=gen) * 0.01, param.to(torch.bfloat16) if shadow else None)
    args = tuple(a.to(device) if a is not None else None for a in args)
    return args + (1e-3, 0.9, 0.999, 1e-8, 0.01, 3, 1.0, decoupled)


def _sgd_args(n=64, grad_dtype=torch.float32, momentum=0.9, shadow=True, nesterov=False, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen)
    args = (param, torch.randn(n, generator=gen).to(grad_dtype),
            torch.randn(n, generator=gen) if momentum else None, param.to(torch.bfloat16) if shadow else None)
    args = tuple(a.to(device) if a is not None else None for a in args)
    return args + (0.05, momentum, 0.0, 1e-3, nesterov, False, 0.5)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shadow", [False, True])
@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_step_opcheck(grad_dtype, shadow, decoupled):
    torch.library.opcheck(torch.ops.hydra.adam_step.default,
                          _adam_args(grad_dtype=grad_dtype, shadow=shadow, decoupled=decoupled))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum,shadow,nesterov", [(0.0, False, False), (0.9, True, False), (0.9, False, True)])
def test_sgd_step_opcheck(grad_dtype, momentum, shadow, nesterov):
    torch.library.opcheck(torch.ops.hydra.sgd_step.default,
                          _sgd_args(grad_dtype=grad_dtype, momentum=momentum, shadow=shadow, nesterov=nesterov))


def _grads(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=gen).to(dtype) for _ in range(STEPS)]


@pytest.mark.parametrize("optimizer,decoupled", [(torch.optim.AdamW, True), (torch.optim.Adam, False)])
@pytest.mark.parametrize("grad_dtype,grad_scale", [(torch.float32, 1.0), (torch.bfloat16, 1.0), (torch.float32, 0.3)])
@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_adam_matches_torch_optim(optimizer, decoupled, grad_dtype, grad_scale, beta1):
    hyper = dict(lr=1e-2, betas=(beta1, 0.999), eps=1e-8, weight_decay=0.05)
    start = torch.randn(N, generator=torch.Generator().manual_seed(1))
    ref = start.clone().requires_grad_(True)
    reference = optimizer([ref], **hyper)
    param, exp_avg, exp_avg_sq = start.clone(), torch.zeros(N), torch.zeros(N)
    shadow = torch.empty(N, dtype=torch.bfloat16)
    for step, grad in enumerate(_grads(2, grad_dtype), start=1):
        ref.grad = grad.float() * grad_scale
        reference.step()
        ops.adam_step(param, grad, exp_avg, exp_avg_sq, shadow, lr=hyper["lr"], step=step, beta1=beta1, beta2=0.999,
                      eps=1e-8, weight_decay=0.05, grad_scale=grad_scale, decoupled=decoupled)
    state = reference.state[ref]
    # ATen's sqrt is off by an ulp for some inputs, ours is correctly rounded; nothing else differs.
    torch.testing.assert_close(param, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(exp_avg, state["exp_avg"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(exp_avg_sq, state["exp_avg_sq"], rtol=1e-6, atol=1e-7)
    if decoupled:  # AdamW's moments never see the parameter, so they match bit for bit
        assert torch.equal(exp_avg, state["exp_avg"]) and torch.equal(exp_avg_sq, state["exp_avg_sq"])
    assert torch.equal(shadow.view(torch.int16), param.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum,dampening,nesterov,weight_decay",
                         [(0.0, 0.0, False, 0.0), (0.0, 0.0, False, 1e-2), (0.9, 0.0, False, 1e-3),
                          (0.9, 0.2, False, 0.0), (0.9, 0.0, True, 1e-3)])
def test_sgd_matches_torch_optim(grad_dtype, momentum, dampening, nesterov, weight_decay):
    hyper = dict(lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay)
    start = torch.randn(N, generator=torch.Generator().manual_seed(3))
    ref = start.clone().requires_grad_(True)
    reference = torch.optim.SGD([ref], **hyper)
    param, buf = start.clone(), torch.full((N,), float("nan")) if momentum else None
    shadow = torch.empty(N, dtype=torch.bfloat16)
    for step, grad in enumerate(_grads(4, grad_dtype)):
        ref.grad = grad.float()
        reference.step()
        ops.sgd_step(param, grad, buf, shadow, first_step=step == 0, **hyper)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        # Same operations, same FMAs as ATen's vectorised kernels on these CPUs: identical bits.
        assert torch.equal(param, ref.detach())
    torch.testing.assert_close(param, ref.detach(), rtol=1e-6, atol=1e-7)
    if momentum:
        torch.testing.assert_close(buf, reference.state[ref]["momentum_buffer"], rtol=1e-6, atol=1e-7)
    assert torch.equal(shadow.view(torch.int16), param.to(torch.bfloat16).view(torch.int16))


def _overlapping_halves(numel=64, offset=32):
    storage = torch.zeros(numel + offset)
    return storage[:numel], storage[offset:]


def test_state_in_disjoint_views_of_one_buffer_is_accepted():
    # The engine keeps exp_avg and exp_avg_sq in one flat allocation; disjoint views must work and match.
    param, grad, exp_avg, exp_avg_sq, shadow, *hyper = _adam_args()
    flat = torch.cat([exp_avg, exp_avg_sq])
    state_avg, state_avg_sq = flat[:64], flat[64:]
    param_copy = param.clone()
    torch.ops.hydra.adam_step(param, grad, exp_avg, exp_avg_sq, shadow, *hyper)
    torch.ops.hydra.adam_step(param_copy, grad, state_avg, state_avg_sq, None, *hyper)
    assert torch.equal(param, param_copy) and torch.equal(state_avg, exp_avg) and torch.equal(state_avg_sq, exp_avg_sq)


def _bad_adam_calls():
    def with_(**changes):
        names = ["param", "grad", "exp_avg", "exp_avg_sq", "shadow", "lr", "beta1", "beta2", "eps",
                 "weight_decay", "step", "grad_scale", "decoupled"]
        args = dict(zip(names, _adam_args()))
        for name, change in changes.items():
            args[name] = change(args)
        return args
    first, second = _overlapping_halves()
    return {
        "param not contiguous": ("param must be contiguous", with_(param=lambda a: torch.randn(4, 16).t())),
        "param float64": ("param must be a float32", with_(param=lambda a: a["param"].double())),
        "grad int": ("grad must be float32 or bfloat16", with_(grad=lambda a: a["grad"].int())),
        "grad wrong size": ("grad has 63 elements", with_(grad=lambda a: a["grad"][:-1].clone())),
        "exp_avg_sq wrong size": ("exp_avg_sq has 65 elements", with_(exp_avg_sq=lambda a: torch.zeros(65))),
        "exp_avg bfloat16": ("exp_avg must be Float", with_(exp_avg=lambda a: a["exp_avg"].bfloat16())),
        "shadow float32": ("shadow must be BFloat16", with_(shadow=lambda a: torch.zeros(64))),
        "exp_avg is param": ("must not overlap", with_(exp_avg=lambda a: a["param"])),
        "exp_avg_sq overlaps exp_avg": ("must not overlap", with_(exp_avg=lambda a: first, exp_avg_sq=lambda a: second)),
        # Messages with numbers check that the native library formats them: with a second, static copy of
        # libstdc++ inside the extension, number formatting broke (truncated messages, or a crash).
        "step 0": (r"step must be >= 1 .*, got 0$", with_(step=lambda a: 0)),
        "negative lr": ("lr must be >= 0, got -0.001$", with_(lr=lambda a: -1e-3)),
        "beta2 1": (r"beta2 must be in \[0, 1\), got 1$", with_(beta2=lambda a: 1.0)),
        "grad_scale inf": ("grad_scale must be finite and >= 0, got inf$", with_(grad_scale=lambda a: float("inf"))),
    }


@pytest.mark.parametrize("case", list(_bad_adam_calls()))
def test_adam_rejects_bad_arguments_without_mutating(case):
    message, args = _bad_adam_calls()[case]
    tensors = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
    before = {k: v.clone() for k, v in tensors.items()}
    with pytest.raises(RuntimeError, match=message):
        torch.ops.hydra.adam_step(*args.values())
    for name, tensor in tensors.items():
        assert torch.equal(tensor, before[name]), f"{name} was modified"


@pytest.mark.parametrize("case,message", [("momentum without buffer", "needs a momentum_buffer"),
                                          ("nesterov with dampening", "nesterov needs"),
                                          ("buffer wrong dtype", "momentum_buffer must be Float"),
                                          ("shadow wrong size", "shadow has 10 elements"),
                                          ("negative momentum", "momentum must be >= 0")])
def test_sgd_rejects_bad_arguments_without_mutating(case, message):
    param, grad, buf, shadow, lr, momentum, dampening, wd, nesterov, first, scale = _sgd_args()
    if case == "momentum without buffer":
        buf = None
    elif case == "nesterov with dampening":
        nesterov, dampening = True, 0.1
    elif case == "buffer wrong dtype":
        buf = buf.double()
    elif case == "shadow wrong size":
        shadow = shadow[:10].clone()
    elif case == "negative momentum":
        momentum = -0.5
    tensors = [t for t in (param, grad, buf, shadow) if t is not None]
    before = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.hydra.sgd_step(param, grad, buf, shadow, lr, momentum, dampening, wd, nesterov, first, scale)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


def test_adam_step_under_torch_compile_fullgraph():
    def train_step(param, grad, exp_avg, exp_avg_sq, shadow):
        ops.adam_step(param, grad * 2.0, exp_avg, exp_avg_sq, shadow, lr=1e-3, step=1, weight_decay=0.01)
        return param.sum()

    compiled = torch.compile(train_step, fullgraph=True)
    eager_args = _adam_args(n=1000)[:5]
    compiled_args = tuple(t.clone() for t in eager_args)
    expected = train_step(*eager_args)
    got = compiled(*compiled_args)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)  # inductor may sum in another order
    for e, c in zip(eager_args, compiled_args):
        assert torch.equal(e, c)  # the in-place updates survive functionalization


@needs_cuda
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_cuda_matches_cpu(grad_dtype, decoupled):
    cpu = _adam_args(n=N, grad_dtype=grad_dtype, decoupled=decoupled)
    cuda = _adam_args(n=N, grad_dtype=grad_dtype, decoupled=decoupled, device="cuda")
    torch.ops.hydra.adam_step(*cpu)
    torch.ops.hydra.adam_step(*cuda)
    for c, g in zip(cpu[:5], cuda[:5]):
        torch.testing.assert_close(g.cpu(), c, rtol=1e-6, atol=1e-7)


@needs_cuda
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_sgd_cuda_matches_cpu(grad_dtype, momentum, nesterov):
    cpu = _sgd_args(n=N, grad_dtype=grad_dtype, momentum=momentum, nesterov=nesterov)
    cuda = _sgd_args(n=N, grad_dtype=grad_dtype, momentum=momentum, nesterov=nesterov, device="cuda")
    torch.ops.hydra.sgd_step(*cpu)
    torch.ops.hydra.sgd_step(*cuda)
    for c, g in zip(cpu[:4], cuda[:4]):
        if c is not None:
            torch.testing.assert_close(g.cpu(), c, rtol=1e-6, atol=1e-7)


@needs_cuda
def test_cuda_op_under_torch_compile():
    args = _sgd_args(n=4096, device="cuda")
    expected = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in args)
    torch.ops.hydra.sgd_step(*expected)
    torch.compile(lambda *a: torch.ops.hydra.sgd_step(*a), fullgraph=True)(*args)
    for e, g in zip(expected[:4], args[:4]):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
