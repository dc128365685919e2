"""
Which scaled-dot-product-attention kernel runs: chosen, not defaulted (--attention).

torch's SDPA picks a backend per call from what the inputs allow; on Hopper cuDNN's kernel can beat FlashAttention-2
for training shapes, and which one wins depends on the shape, so `auto` times each allowed backend once on the run's
own attention shape and keeps the fastest. The choice is applied through torch's global SDPA switches, which both
eager calls and compiled graphs (traced after the choice) obey, so gpt.py needs no flag.
"""

import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
CHOICES = ("auto", *BACKENDS)

# the aten op each backend dispatches to (a profile's event names), CPU's own flash kernel included
OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_attention_math": "math",
}

SWITCHES = {  # torch.backends.cuda's global enable flags, by backend
    "flash": torch.backends.cuda.enable_flash_sdp,
    "cudnn": torch.backends.cuda.enable_cudnn_sdp,
    "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
    "math": torch.backends.cuda.enable_math_sdp,
}


def check_choice(name):
    if name not in CHOICES:
        raise ValueError(f"--attention={name!r} is unknown; choose one of {', '.join(CHOICES)}")
    return name


def attention_inputs(batch, n_head, n_kv_head, seq_len, head_dim, device, dtype, grad=True):
    """Random q, k, v of the model's attention shape (batch, heads, time, head_dim), as gpt.py passes them."""
    shapes = [(batch, n_head, seq_len, head_dim)] + [(batch, n_kv_head, seq_len, head_dim)] * 2
    return [torch.randn(s, device=device, dtype=dtype, requires_grad=grad) for s in shapes]


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1))


def backend_that_runs(q, k, v):
    """The backend SDPA dispatches these inputs to under the current switches (from a profile's op names)."""
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attend(q, k, v)
    ran = {OPS[e.name] for e in prof.events() if e.name in OPS}
    return ran.pop() if len(ran) == 1 else (", ".join(sorted(ran)) or "unknown")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_backend(name, q, k, v, repeats=10):
    """Median seconds of one forward + backward through the named backend, or the error that refused the inputs."""
    def once():
        q.grad = k.grad = v.grad = None
        sync(q.device)
        t0 = time.perf_counter()
        attend(q, k, v).sum().backward()
        sync(q.device)
        return time.perf_counter() - t0

    try:
        with sdpa_kernel([BACKENDS[name]]):
            once()  # warm-up: kernel selection, workspace, cuDNN's plan
            return statistics.median(once() for _ in range(repeats))
    except RuntimeError as e:  # "No available kernel": this backend does not take these inputs (dtype, device, shape)
        return f"not available: {str(e).strip().splitlines()[0][:120]}"


def time_backends(q, k, v, names=tuple(BACKENDS), repeats=10):
    """{backend: seconds, or the reason it could not run} for fwd+bwd at these inputs."""
    return {name: time_backend(name, q, k, v, repeats) for name in names}


def fastest(timings):
    usable = {name: s for name, s in timings.items() if isinstance(s, float)}
    if not usable:
        raise RuntimeError(f"no SDPA backend ran these inputs: {timings}")
    return min(usable, key=usable.get)


def apply(name):
    """Allow only the named backend from here on (every call, eager or compiled); math stays as the fallback of
    inputs the chosen one refuses (a KV cache's mask), so a choice never makes a call fail."""
    for backend, switch in SWITCHES.items():
        switch(backend in (name, "math"))


def choose(name, config, batch, device, dtype, log=print):
    """Settle --attention for a run: auto times each backend at (batch, the model's heads, sequence_len) and keeps
    the fastest; a named backend is taken as is. Returns the backend's name; CPU keeps torch's own choice."""
    check_choice(name)
    if device.type != "cuda":
        return "default (cpu)"
    if name == "auto":
        q, k, v = attention_inputs(batch, config.n_head, config.n_kv_head, config.sequence_len,
                                   config.n_embd // config.n_head, device, dtype)
        timings = time_backends(q, k, v, repeats=3)
        name = fastest(timings)
        log("attention: auto chose " + name + " (fwd+bwd " + ", ".join(
            f"{b} {s * 1e3:.2f} ms" if isinstance(s, float) else f"{b} n/a" for b, s in timings.items()) + ")")
    apply(name)
    return name


@contextlib.contextmanager
def only(name):
    """The named backend inside the block (tests and the GPU kit; runs use apply)."""
    with sdpa_kernel([BACKENDS[name]]):
        yield
