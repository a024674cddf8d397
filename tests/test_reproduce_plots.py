from __future__ import annotations

from eldr.reproduce.plots import plot_bars


def test_plot_bars_writes_a_png_with_negative_bars(tmp_path):
    path = tmp_path / "bars.png"
    plot_bars(["a", "b", "c"], {"p50": [-3.0, 1.5, 0.0], "p99": [2.0, -1.0, 4.0]},
              "title", "% vs best LB", path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reproduce_without_matplotlib_names_the_extra_in_one_line(monkeypatch, capsys):
    import importlib.util

    from eldr.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["reproduce", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "eldr[report]" in err and err.startswith("eldr reproduce:")
