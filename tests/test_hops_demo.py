"""dev/hops_demo.py, the CPU hops demo (dev/runcpu_hops.sh is one seed of it): its own file, so that a pytest worker
runs it beside tests/test_hops.py's 800-step regression test rather than after it."""


def test_the_demo_runs_the_recursion_and_the_plain_block_and_tells_who_climbs(tmp_path, monkeypatch, capsys):
    """dev/hops_demo.py end to end at toy size (20 steps, 2 seeds' worth of tags on one seed): both models trained
    through base_train, scored by base_loss --hops, one JSON line and a table; and the verdicts read from rows the
    test writes itself."""
    import json

    import dev.hops_demo as demo
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.setattr(demo, "CORPUS_FLAGS", [f.replace("60000", "400").replace("9600", "64")
                                               for f in demo.CORPUS_FLAGS])
    monkeypatch.setattr(demo, "HOPS_DOCS", 8)
    out = tmp_path / "demo.jsonl"
    demo.main(["--seeds", "3", "--plain", "--name", "toy", "--n_sup_eval", "2", "--out", str(out), "--",
               "--num_iterations=4", "--eval_every=0", "--save_every=0", "--n_sup_train=2"])
    row = json.loads(out.read_text())
    assert row["seed"] == 3 and len(row["accuracy"]) == 2 and 0 <= row["plain_longest"] <= 1
    assert (tmp_path / "base_checkpoints" / "hops_toy_s3").is_dir()
    assert (tmp_path / "base_checkpoints" / "hops_toy_plain_s3").is_dir()
    assert "toy seed 3: 3 hops at steps 1 / N / 2N / 4N" in capsys.readouterr().out
    climbed = {"name": "r", "seed": 1, "n_sup_train": 1, "accuracy": [[1.0, 0.9]] * 4}
    plateau = {**climbed, "seed": 2, "accuracy": [[0.3, 0.2]] * 4}
    drifted = {**climbed, "seed": 4, "accuracy": [[1.0, 0.9], [1.0, 0.8], [1.0, 0.8], [1.0, 0.7]]}
    assert demo.verdict(climbed)[1:] == (True, True) and demo.verdict(plateau)[1:] == (False, False)
    assert demo.verdict(drifted)[1:] == (True, False)
    assert "| r | 0.90 / 0.90 / 0.90 / 0.90 | plateau (0.20) | 0.90 / 0.90 / 0.80 / 0.70 | 2 of 3 | 1 of 3 |" in \
        demo.table([climbed, plateau, drifted])
