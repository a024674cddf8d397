import json

import numpy as np

from _learn_data import K, records
from eldr.cli import main
from eldr.learn import buffer as buffer_io
from eldr.traces import trace as trace_io


def test_export_and_status(tmp_path, capsys):
    rng = np.random.default_rng(0)
    recs = records(rng, [0, 1, 2]) + records(rng, [3], with_decode=False)
    buffer_io.save(tmp_path / "learn" / "buffer", recs, model="tiny", top_k=K, num_seen=9,
                   num_dropped=5, state={"fits": 2, "accepted": 1})
    assert main(["learn", "export", str(tmp_path / "learn"), "-o",
                 str(tmp_path / "t.npz")]) == 0
    assert trace_io.load(tmp_path / "t.npz").num_requests == 4
    assert main(["learn", "export", str(tmp_path / "learn"), "--decode-only", "-o",
                 str(tmp_path / "d.npz")]) == 0
    assert trace_io.load(tmp_path / "d.npz").num_requests == 3
    capsys.readouterr()
    assert main(["learn", "status", str(tmp_path / "learn"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["requests"], info["with_decode"], info["seen"], info["fits"]) == (4, 3, 9, 2)


def test_export_of_an_empty_directory_is_a_clear_error(tmp_path, capsys):
    assert main(["learn", "export", str(tmp_path), "-o", str(tmp_path / "t.npz")]) == 2
    assert "no buffered requests" in capsys.readouterr().err
