"""eldr calibrate: a hardware file from recorded /eldr/steps documents of a GPU-shaped
model (48 layers x 128 experts, made here from known constants) and from stub engines
(aiohttp) serving /eldr/steps, a 404 of a plain engine, too few steps."""

import asyncio
import json
import threading

import numpy as np
import pytest

from eldr.capture.decode import StepRing
from eldr.cli import main
from eldr.sim.hardware import load_hardware

T0, B_US, C_US = 2.0e-3, 2.22, 4.0  # known constants: seconds, µs, µs


def _ring_doc(n=800, *, seed=0, layers=48, experts=128, top_k=8, noise=15e-6, mixed_every=9):
    """A step ring of ``n`` decode steps at batch sizes 1..128 of a qwen3-30b-a3b-shaped
    model: Σ_l D_l from uniform top-8 routing, t = T0 + b·ΣD + c·B + noise; every
    ``mixed_every``-th step also ran a prompt (50 ms more: must be left out)."""
    rng = np.random.default_rng(seed)
    ring = StepRing(4096)
    for i in range(n):
        B = int(rng.integers(1, 129))
        hit = 1 - (1 - top_k / experts) ** B
        D = int(rng.binomial(experts, hit, layers).sum())
        mixed = mixed_every and i % mixed_every == 0
        t = T0 + B_US * 1e-6 * D + C_US * 1e-6 * B + rng.normal(0, noise) + 0.05 * mixed
        ring.push(t, B, D, bool(mixed))
    return ring.snapshot(layers, experts, 0.0)


def test_fit_from_a_recorded_gpu_shaped_ring(tmp_path, capsys):
    rec = tmp_path / "steps.json"
    rec.write_text(json.dumps(_ring_doc()))
    out = tmp_path / "hw.json"
    assert main(["calibrate", "--metrics-file", str(rec), "--model", "qwen3-30b-a3b",
                 "-o", str(out), "--name", "test-gpu"]) == 0
    hw = load_hardware(out)
    ((model, a_us, b_us),) = hw.moe_fits
    assert model == "qwen3-30b-a3b" and a_us == 0.0
    assert b_us == pytest.approx(B_US, rel=0.03)
    assert (hw.name, hw.hbm_bandwidth, hw.peak_flops) == ("test-gpu", 4.8e12, 989e12)
    doc = json.loads(out.read_text())
    assert doc["moe_fits"][0]["c_us"] == pytest.approx(C_US, rel=0.1)
    assert doc["moe_fits"][0]["r2"] > 0.99
    assert doc["source"]["how"] == "eldr calibrate" and doc["source"]["files"] == [str(rec)]
    assert doc["source"]["t0_us"] == pytest.approx(T0 * 1e6, rel=0.02)
    text = capsys.readouterr().out
    assert "left out" in text and "b = 2.2" in text and "R² = " in text
    # the file drives the simulator
    from eldr.sim.config import SimConfig

    assert SimConfig(model="qwen3-30b-a3b", hardware=str(out)).hardware == str(out)


def test_refusals_of_recorded_files(tmp_path, capsys):
    rec = tmp_path / "steps.json"
    rec.write_text(json.dumps(_ring_doc(n=20)))
    args = ["calibrate", "--metrics-file", str(rec), "--model", "qwen3-30b-a3b", "-o",
            str(tmp_path / "hw.json")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "17 timed decode steps without prompt rows, 30 needed: send at least 1 more" in err
    assert "\n" not in err
    assert main([*args[:4], "tiny-moe", *args[5:]]) == 2
    assert "48 MoE layers, but --model tiny-moe has 6" in capsys.readouterr().err
    rec.write_text("{]")
    assert main(args) == 2 and "not JSON" in capsys.readouterr().err
    assert main(["calibrate", "--model", "tiny-moe", "-o", "x.json"]) == 2
    assert "--engine URL or --metrics-file" in capsys.readouterr().err
    assert not (tmp_path / "hw.json").exists()


class _Stub:
    """aiohttp engines in a thread: ``routes`` path -> (status, body)."""

    def __init__(self, routes: dict):
        from aiohttp import web

        self.routes, self.loop = routes, asyncio.new_event_loop()
        self.app = web.Application()
        self.app.router.add_get("/{tail:.*}", self._answer)
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    async def _answer(self, request):
        from aiohttp import web

        status, body = self.routes.get(request.path, (404, '{"detail":"Not Found"}'))
        return web.Response(status=status, text=body, content_type="application/json")

    def _serve(self, ready):
        from aiohttp import web

        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        ready.set()
        self.loop.run_forever()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def stubs():
    pytest.importorskip("aiohttp")
    made = []
    yield lambda routes: made.append(_Stub(routes)) or made[-1]
    for s in made:
        s.close()


def test_live_engines_are_read_and_combined(tmp_path, stubs, capsys):
    one = stubs({"/eldr/steps": (200, json.dumps(_ring_doc(n=300, seed=1))),
                 "/metrics": (200, "eldr_engine_step_seconds_count 300.0\n")})
    two = stubs({"/eldr/steps": (200, json.dumps(_ring_doc(n=300, seed=2)))})
    out = tmp_path / "hw.json"
    assert main(["calibrate", "--engine", one.url, "--engine", two.url, "--model",
                 "qwen3-30b-a3b", "-o", str(out)]) == 0
    assert load_hardware(out).moe_fits[0][2] == pytest.approx(B_US, rel=0.03)
    assert json.loads(out.read_text())["source"]["engines"] == [one.url, two.url]
    captured = capsys.readouterr()
    assert "fit over 532 decode steps" in captured.out  # 2 x (300 - 34 mixed)
    assert f"{two.url}: no eldr_engine_step_seconds on /metrics" in captured.err


def test_an_engine_without_the_plugin_and_one_without_steps(tmp_path, stubs, capsys):
    plain = stubs({})
    out = str(tmp_path / "hw.json")
    assert main(["calibrate", "--engine", plain.url, "--model", "tiny-moe", "-o", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"eldr calibrate: engine {plain.url} has no eldr plugin (GET /eldr/steps: "
                   "404): start it with the eldr capture plugin (eldr cluster does; "
                   "docs/capture.md)"]
    empty = stubs({"/eldr/steps": (404, '{"error": "no timed decode step yet", '
                                        '"eldr_steps": 0}')})
    assert main(["calibrate", "--engine", empty.url, "--model", "tiny-moe", "-o", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "0 timed decode steps without prompt rows, 30 needed: send at least 2 more " \
        "requests" in err
    assert f"({empty.url}: no timed decode step yet; an engine times its decode steps " \
        "with a KV connector or ELDR_CAPTURE=all)" in err
    assert main(["calibrate", "--engine", "http://127.0.0.1:9", "--model", "tiny-moe",
                 "-o", out]) == 2
    assert "not reachable" in capsys.readouterr().err
