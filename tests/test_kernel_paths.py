"""The float-sensitive test list and the script that reruns it on other kernel paths."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import FLOAT_SENSITIVE

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "other_kernels.sh"
FORCED = ("OPENBLAS_CORETYPE", "MKL_CBWR", "NPY_DISABLE_CPU_FEATURES", "OMP_NUM_THREADS",
          "OPENBLAS_NUM_THREADS")


def test_every_listed_file_exists():
    here = {p.name for p in Path(__file__).parent.glob("test_*.py")}
    assert sorted(FLOAT_SENSITIVE - here) == []


class _Item:
    def __init__(self, name: str):
        self.path, self.markers = Path(name), []

    def add_marker(self, marker):
        self.markers.append(marker.name)


def test_listed_files_get_the_floats_marker(request):
    from conftest import pytest_collection_modifyitems

    items = [_Item("test_sim_golden.py"), _Item("test_kernel_paths.py")]
    pytest_collection_modifyitems(request.config, items)
    assert [i.markers for i in items] == [["floats"], []]
    assert request.node.get_closest_marker("floats") is None  # this file is not listed


def _forced_env(**overrides) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in FORCED}
    env.update(overrides, PYTHON=sys.executable)
    code = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {FORCED!r}}}))"
    out = subprocess.run(["bash", str(SCRIPT), sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def test_the_script_forces_other_kernels():
    got = _forced_env()
    if os.uname().machine == "x86_64":
        assert got["OPENBLAS_CORETYPE"] == "Prescott"
    assert got["MKL_CBWR"] == "COMPATIBLE"
    assert got["OMP_NUM_THREADS"] == got["OPENBLAS_NUM_THREADS"] == "1"
    from numpy._core._multiarray_umath import __cpu_dispatch__
    assert got["NPY_DISABLE_CPU_FEATURES"].split() == list(__cpu_dispatch__)


def test_a_setting_can_be_overridden_or_left_to_the_machine():
    got = _forced_env(MKL_CBWR="AVX2", OMP_NUM_THREADS="")
    assert got["MKL_CBWR"] == "AVX2"
    assert got["OMP_NUM_THREADS"] is None  # "" keeps the machine's own choice


def test_the_script_without_a_command_exits_2():
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage" in out.stderr
