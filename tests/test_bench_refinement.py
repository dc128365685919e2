"""dev/bench_refinement.py on a tiny model: it runs, checks both generations made the same tokens, and prints both."""

import re

import pytest

from dev import bench_refinement

TINY = ["--depth", "1", "--n_embd", "32", "--n_head", "2", "--vocab", "64", "--n_sup", "2", "--prompt_tokens", "4",
        "--max_tokens", "4", "--rounds", "1", "--threads", "1"]


@pytest.mark.parametrize("rule", ["kl:0.0005", "rms:0.1", "rms:inf"])
def test_the_benchmark_prints_both_timings_and_the_overhead(capsys, rule):
    bench_refinement.main(TINY + ["--halt", rule])
    out = capsys.readouterr().out
    for clock in ("wall", "cpu"):
        for name in ("plain", "per-step"):
            line = rf"^{clock} +{name} +time to first token +[\d.]+ ms +per token +[\d.]+ ms$"
            assert re.search(line, out, re.M), out
        overhead = rf"^{clock} +overhead +time to first token [+-][\d.]+% +per token [+-][\d.]+%$"
        assert re.search(overhead, out, re.M), out


def test_different_tokens_are_an_error(monkeypatch):
    real = bench_refinement.refinement.generate

    def off_by_one(engine, request):
        for event in real(engine, request):
            yield {**event, "id": event["id"] + 1} if event["object"] == "refinement.token" else event

    monkeypatch.setattr(bench_refinement.refinement, "generate", off_by_one)
    with pytest.raises(SystemExit, match="other tokens"):
        bench_refinement.main(TINY)
