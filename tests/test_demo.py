"""The main job, end to end, with its smallest settings."""
import logging
import re

import torch
from transformers.utils import logging as hf_logging

from hydra_torch import demo


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_demo_runs_and_names_the_best(tmp_path, capsys):
    chart = tmp_path / "schedule.png"
    threads = torch.get_num_threads()
    transformers_log = _Records()
    hf_logging.add_handler(transformers_log)
    try:
        code = demo.main(["--steps", "3", "--widths", "16", "64", "--lrs", "1e-3", "--layers", "2", "--heads", "2",
                          "--corpus-bytes", "200000", "--vocab", "300", "--seq", "16", "--batch", "2",
                          "--no-progress", "--chart", str(chart), "--curves", str(tmp_path / "curves.png")])
    finally:
        hf_logging.remove_handler(transformers_log)
    out = capsys.readouterr().out
    assert code == 0
    assert "best configuration: w" in out
    assert "valid loss" in out and "tokens/s" in out
    assert chart.stat().st_size > 1000
    assert torch.get_num_threads() == threads, "virtual devices restore the thread count"
    # Each configuration's own throughput, and the aggregate apart from them.
    rates = {name: int(rate) for name, rate in re.findall(r"^(w\d+-lr\S+)\s.*\s(\d+)$", out, re.MULTILINE)}
    assert set(rates) == {"w16-lr0.001", "w64-lr0.001"} and rates["w16-lr0.001"] != rates["w64-lr0.001"]
    assert re.search(r"all configurations: \d+ tokens/s", out)
    assert not [m for m in transformers_log.messages if "loss_type" in m], transformers_log.messages


SMALL = ["--steps", "4", "--widths", "16", "32", "--lrs", "1e-3", "3e-3", "--layers", "1", "--heads", "2",
         "--corpus-bytes", "200000", "--vocab", "300", "--seq", "16", "--batch", "2", "--no-progress"]


def test_demo_with_successive_halving_stops_some_configurations(tmp_path, capsys):
    code = demo.main(SMALL + ["--halving", "1", "--chart", "", "--curves", str(tmp_path / "curves.png")])
    out = capsys.readouterr().out
    assert code == 0 and "best configuration: w" in out
    assert "(stopped at step" in out
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_demo_search_runs_an_optuna_study(tmp_path, capsys):
    import pytest

    pytest.importorskip("optuna", reason="--search needs the optional Optuna")
    code = demo.main(SMALL + ["--search", "5", "--chart", "", "--curves", str(tmp_path / "curves.png")])
    out = capsys.readouterr().out
    assert code == 0
    assert re.search(r"best trial: \d+, width (16|32), lr ", out), out
    assert "trials pruned" in out


def test_demo_trains_another_family(capsys):
    code = demo.main(SMALL + ["--arch", "gemma2", "--chart", "", "--curves", ""])
    out = capsys.readouterr().out
    assert code == 0 and "4 gemma2 configurations" in out and "best configuration: w" in out


def test_demo_compares_lora_ranks_on_one_base(capsys):
    import pytest

    pytest.importorskip("peft", reason="--lora-ranks needs the optional peft")
    code = demo.main(SMALL + ["--arch", "llama", "--lora-ranks", "2", "8", "--chart", "", "--curves", ""])
    out = capsys.readouterr().out
    assert code == 0 and "best configuration: r" in out
    names = set(re.findall(r"^(r\d+-lr\S+)\s", out, re.MULTILINE))
    assert names == {"r2-lr0.001", "r2-lr0.003", "r8-lr0.001", "r8-lr0.003"}
    assert "shared base 'llama'" in out and "for 4 configurations" in out  # one base, held once


def test_demo_refuses_pretrained_weights_of_another_family():
    import pytest

    with pytest.raises(SystemExit, match="gpt2"):
        demo.main(SMALL + ["--arch", "llama", "--pretrained"])


def test_demo_refuses_bad_arguments_before_preparing_anything(capsys):
    # Before, each ended in a traceback, some after the text and tokenizer were prepared (a zero division for
    # --heads 0, a reshape error in every configuration for --seq 0).
    import pytest

    for arguments, says in [(["--heads", "0"], "--heads: must be a positive int, got 0"),
                            (["--seq", "0"], "--seq: must be a positive int, got 0"),
                            (["--lrs", "nan"], "--lrs: must be a positive float, got nan"),
                            (["--lrs", "inf"], "--lrs: must be a positive float, got inf"),
                            (["--widths", "30", "--heads", "4"], "--heads 4 must divide every width, not 30"),
                            # Both were a traceback after the whole run, the results unreported.
                            (["--chart", "/nonexistent/dir/s.png"], "--chart: no folder /nonexistent/dir to write"),
                            (["--curves", "curves.xyz"], "--curves: a chart is written as one of")]:
        with pytest.raises(SystemExit) as exit_:
            demo.main(SMALL + arguments)
        assert exit_.value.code == 2
        captured = capsys.readouterr()
        assert says in captured.err and "preparing text" not in captured.out


def test_demo_says_what_hydra_torch_refused_without_a_traceback():
    import pytest

    with pytest.raises(SystemExit, match=r"^error: task '.*': memory budget too small"):
        demo.main(SMALL + ["--budget", "1KB", "--chart", "", "--curves", ""])
