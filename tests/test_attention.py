"""--attention: the choice is checked, applied through torch's SDPA switches, auto keeps the fastest, and every
backend that runs here computes the model's attention alike."""

import contextlib

import pytest
import torch

from nanochat.model.gpt import GPT, GPTConfig
from nanochat.train import attention

FLAGS = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled") for name in ("flash", "cudnn", "mem_efficient",
                                                                                    "math")}


@pytest.fixture
def switches():
    """The global SDPA switches, put back as they were after the test."""
    before = {name: read() for name, read in FLAGS.items()}
    yield lambda: {name: read() for name, read in FLAGS.items()}
    for name, on in before.items():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)


def test_an_unknown_choice_names_the_valid_ones():
    with pytest.raises(ValueError, match="--attention='flash3' is unknown; choose one of auto, flash, cudnn"):
        attention.check_choice("flash3")


def test_a_named_backend_is_the_only_one_allowed_beside_math(switches):
    attention.apply("cudnn")
    assert switches() == {"flash": False, "cudnn": True, "mem_efficient": False, "math": True}
    attention.apply("flash")
    assert switches() == {"flash": True, "cudnn": False, "mem_efficient": False, "math": True}


def test_auto_on_cuda_switches_to_a_clearly_faster_backend_and_logs_why(switches, monkeypatch):
    timings = {"flash": 1.75e-3, "cudnn": 1.06e-3, "efficient": "not available: shape", "math": 1.4e-2}
    monkeypatch.setattr(attention, "measure", lambda *args: (timings, "flash"))  # a stand-in CUDA's medians
    logged = []
    chosen = attention.choose("auto", GPTConfig(), 4, torch.device("cuda"), torch.bfloat16, log=logged.append)
    assert chosen == "cudnn" and switches()["cudnn"] and not switches()["flash"]
    assert logged == ["attention: auto kept cudnn, 1.65x faster than SDPA's own flash (fwd+bwd median of 20: flash "
                      "1.75 ms, cudnn 1.06 ms, efficient n/a, math 14.00 ms)"]


def test_auto_keeps_sdpas_own_pick_when_another_is_faster_only_by_noise(switches, monkeypatch):
    # the kit saw flash, cudnn and efficient win in turn across seeds on gaps of 0.03 ms: within the margin, SDPA's
    # own pick stays and the switches are left alone
    before = switches()
    timings = {"flash": 1.10e-3, "cudnn": 1.07e-3, "efficient": 1.08e-3, "math": 1.4e-2}
    monkeypatch.setattr(attention, "measure", lambda *args: (timings, "cudnn"))
    assert attention.choose("auto", GPTConfig(), 4, torch.device("cuda"), torch.bfloat16, log=lambda _: None) == "cudnn"
    monkeypatch.setattr(attention, "measure", lambda *args: (timings, "flash"))
    assert attention.choose("auto", GPTConfig(), 4, torch.device("cuda"), torch.bfloat16, log=lambda _: None) == "flash"
    assert switches() == before
    assert attention.decide({"flash": 1e-3, "math": 2e-3}, "unknown") == ("flash", "the fastest (unknown is not timed "
                                                                                   "here)")
    assert attention.decide({"flash": 0.95e-3, "cudnn": 1e-3}, "cudnn")[0] == "cudnn"  # 5%: not enough
    assert attention.decide({"flash": 0.85e-3, "cudnn": 1e-3}, "cudnn")[0] == "flash"  # 15%: enough


def test_auto_times_every_backend_in_interleaved_rounds(monkeypatch):
    # each round times every backend that runs once, in alternating order; one that cannot run is timed no more
    # a round each: flash once slow (a clock change), the median is its usual time
    calls, allowed = [], []
    seconds = {"flash": iter([2e-3, 9e-3, 2e-3, 2e-3]), "cudnn": iter([1e-3] * 4), "math": iter([9e-3] * 4)}
    names = {backend: name for name, backend in attention.BACKENDS.items()}

    @contextlib.contextmanager
    def only(backends):  # a stand-in for torch's switches: remembers which backend a round allows
        allowed.append(names[backends[0]])
        yield

    def fake_time(name, q, k, v, repeats=10):  # the first pass: who runs
        calls.append(name)
        return "not available: no" if name == "efficient" else 0.0

    def fake_fwd_bwd(q, k, v):
        calls.append(allowed[-1])
        return next(seconds[allowed[-1]])

    monkeypatch.setattr(attention, "time_backend", fake_time)
    monkeypatch.setattr(attention, "sdpa_kernel", only)
    monkeypatch.setattr(attention, "fwd_bwd_seconds", fake_fwd_bwd)
    medians = attention.time_rounds(None, None, None, rounds=4)
    assert calls == ["flash", "cudnn", "efficient", "math"] + ["math", "cudnn", "flash", "flash", "cudnn", "math"] * 2
    assert medians == {"flash": 2e-3, "cudnn": 1e-3, "efficient": "not available: no", "math": 9e-3}


def test_on_cpu_the_choice_leaves_torch_to_pick(switches):
    before = switches()
    assert attention.choose("cudnn", GPTConfig(), 4, torch.device("cpu"), torch.float32) == "default (cpu)"
    assert switches() == before


def test_every_backend_that_runs_here_gives_the_models_logits():
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_loops=1,
                          n_sup_train=2))
    model.init_weights()
    for p in model.parameters():  # zero-initialised projections would hide attention's output
        torch.nn.init.normal_(p, std=0.2)
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        reference = model(idx)
        for name in ("flash", "math"):  # what a CPU runs; cudnn and efficient are CUDA's
            with attention.only(name):
                torch.testing.assert_close(model(idx), reference, atol=1e-5, rtol=1e-5)
    q, k, v = attention.attention_inputs(1, 4, 2, 8, 8, torch.device("cpu"), torch.float32)
    with attention.only("math"):
        assert attention.backend_that_runs(q, k, v) == "math"


def test_base_train_takes_the_flag_with_auto_by_default():
    from nanochat.train import config as train_config
    assert train_config.parse_args(["--depth=1"], world_size=1, check_hardware=False, vocab_size=256).attention \
        == "auto"
    assert train_config.parse_args(["--depth=1", "--attention=cudnn"], world_size=1, check_hardware=False,
                                   vocab_size=256).attention == "cudnn"
    with pytest.raises(SystemExit) as exit_:
        train_config.parse_args(["--depth=1", "--attention=fa3"], world_size=1, check_hardware=False, vocab_size=256)
    assert "argument --attention: invalid choice: 'fa3'" in str(exit_.value.code)  # the one line the CLI prints
