"""The main job, end to end, with its smallest settings."""
import torch

from hydra_torch import demo


def test_demo_runs_and_names_the_best(tmp_path, capsys):
    chart = tmp_path / "schedule.png"
    threads = torch.get_num_threads()
    code = demo.main(["--steps", "3", "--widths", "32", "--lrs", "1e-3", "3e-3", "--layers", "2", "--heads", "2",
                      "--corpus-bytes", "200000", "--vocab", "300", "--seq", "16", "--batch", "2",
                      "--no-progress", "--chart", str(chart)])
    out = capsys.readouterr().out
    assert code == 0
    assert "best configuration: w32-lr" in out
    assert "valid loss" in out and "tokens/s" in out
    assert chart.stat().st_size > 1000
    assert torch.get_num_threads() == threads, "virtual devices restore the thread count"

