from eldr._progress import Progress, track


def test_bar_draws_on_stderr_when_asked(monkeypatch, capsys):
    monkeypatch.setenv("ELDR_PROGRESS", "1")
    assert list(track(range(3), 3, "fitting")) == [0, 1, 2]
    with Progress(2, "capture") as bar:
        bar.update(1, note="prompt 1")
        bar.update(1)
    out, err = capsys.readouterr()
    assert out == ""
    assert "fitting" in err and "3/3" in err
    assert "capture" in err and "2/2" in err


def test_bar_is_silent_when_not_a_terminal_or_disabled(monkeypatch, capsys):
    monkeypatch.delenv("ELDR_PROGRESS", raising=False)
    with Progress(5, "quiet") as bar:  # pytest's stderr is not a terminal
        bar.update(5)
    monkeypatch.setenv("ELDR_PROGRESS", "1")
    with Progress(5, "off", enabled=False) as bar:
        bar.update(2)
    assert bar.done == 2
    assert capsys.readouterr() == ("", "")


def test_env_zero_silences_a_terminal(monkeypatch):
    monkeypatch.setenv("ELDR_PROGRESS", "0")
    assert not Progress(1, "x").enabled
