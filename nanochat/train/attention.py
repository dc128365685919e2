"""
Which scaled-dot-product-attention kernel runs: chosen, not defaulted (--attention).

torch's SDPA picks a backend per call from what the inputs allow; on Hopper cuDNN's kernel can beat FlashAttention-2
for training shapes, and which one wins depends on the shape, so `auto` times each allowed backend on the run's own
attention shape, AUTO_ROUNDS rounds each timing every backend once in turn, and leaves SDPA's own pick unless another
backend's median is AUTO_MARGIN faster (a pick that flipped between flash, cudnn and efficient across seeds on gaps
of 0.03 ms measured noise, not speed). A choice is applied through torch's global SDPA switches, which both eager
calls and compiled graphs (traced after the choice) obey, so gpt.py needs no flag.
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


def fwd_bwd_seconds(q, k, v):
    """Seconds of one forward + backward through the backend the SDPA switches allow."""
    q.grad = k.grad = v.grad = None
    sync(q.device)
    t0 = time.perf_counter()
    attend(q, k, v).sum().backward()
    sync(q.device)
    return time.perf_counter() - t0


def time_backend(name, q, k, v, repeats=10):
    """Median seconds of one forward + backward through the named backend, or the error that refused the inputs."""
    try:
        with sdpa_kernel([BACKENDS[name]]):
            fwd_bwd_seconds(q, k, v)  # warm-up: kernel selection, workspace, cuDNN's plan
            return statistics.median(fwd_bwd_seconds(q, k, v) for _ in range(repeats))
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


AUTO_ROUNDS = 20  # rounds of auto's timing, each backend once a round: a median of 20, not one lucky call
AUTO_MARGIN = 0.10  # how much faster (median) a backend must be than SDPA's own pick for auto to switch to it


def time_rounds(q, k, v, names=tuple(BACKENDS), rounds=AUTO_ROUNDS):
    """{backend: median seconds of fwd+bwd, or why it could not run}: each round times every backend that runs once,
    in alternating order, so a change of clock or load hits them all alike."""
    ran = {name: time_backend(name, q, k, v, repeats=1) for name in names}  # a warm-up each, and who runs at all
    seconds = {name: [] for name, s in ran.items() if isinstance(s, float)}
    for round_ in range(rounds):
        for name in list(seconds)[::1 if round_ % 2 else -1]:
            with sdpa_kernel([BACKENDS[name]]):
                seconds[name].append(fwd_bwd_seconds(q, k, v))
    return {name: statistics.median(seconds[name]) if name in seconds else ran[name] for name in names}


def decide(timings, default, margin=AUTO_MARGIN):
    """(the backend auto keeps, why): SDPA's own pick (`default`), unless another backend's median is `margin`
    faster; the fastest when SDPA's pick did not run or is not one of BACKENDS."""
    best = fastest(timings)
    if not isinstance(timings.get(default), float):
        return best, f"the fastest ({default} is not timed here)"
    if best != default and timings[best] < (1 - margin) * timings[default]:
        return best, f"{timings[default] / timings[best]:.2f}x faster than SDPA's own {default}"
    return default, f"SDPA's own pick: nothing beat it by {margin:.0%}"


def measure(config, batch, device, dtype):
    """(time_rounds at the run's attention shape, the backend SDPA picks there by itself)."""
    q, k, v = attention_inputs(batch, config.n_head, config.n_kv_head, config.sequence_len,
                               config.n_embd // config.n_head, device, dtype)
    return time_rounds(q, k, v), backend_that_runs(q, k, v)


def apply(name):
    """Allow only the named backend from here on (every call, eager or compiled); math stays as the fallback of
    inputs the chosen one refuses (a KV cache's mask), so a choice never makes a call fail."""
    for backend, switch in SWITCHES.items():
        switch(backend in (name, "math"))


def choose(name, config, batch, device, dtype, log=print):
    """Settle --attention for a run: auto times each backend at (batch, the model's heads, sequence_len) and switches
    from SDPA's own pick only by a clear margin (decide); a named backend is taken as is. Returns the backend's
    name; CPU keeps torch's own choice."""
    check_choice(name)
    if device.type != "cuda":
        return "default (cpu)"
    if name == "auto":
        timings, default = measure(config, batch, device, dtype)
        name, why = decide(timings, default)
        log(f"attention: auto kept {name}, {why} (fwd+bwd median of {AUTO_ROUNDS}: " + ", ".join(
            f"{b} {s * 1e3:.2f} ms" if isinstance(s, float) else f"{b} n/a" for b, s in timings.items()) + ")")
        if name == default:
            return name  # the switches as they were: SDPA goes on picking for itself
    apply(name)
    return name


@contextlib.contextmanager
def only(name):
    """The named backend inside the block (tests and the GPU kit; runs use apply)."""
    with sdpa_kernel([BACKENDS[name]]):
        yield
