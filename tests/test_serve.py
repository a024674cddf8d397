"""``eldr serve`` as a process: arguments, start-up, a request, SIGHUP reload, SIGTERM."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from _proxy_fakes import E, FakeEngine, L
from eldr.cli import main
from eldr.commands.serve import config_from_args


def _args(*argv):
    from eldr.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_config_from_args():
    cfg = config_from_args(_args("--prefill", "http://p:1", "--decode", "a=http://d:1",
                                 "--decode", "b=http://d:2", "--policy", "jsq", "--tau", "0.2",
                                 "--model", "tiny", "--admin-token", "0123456789"))
    assert cfg.decode_ids == ("a", "b") and cfg.decode_urls == ("http://d:1", "http://d:2")
    assert cfg.tau == 0.2 and cfg.models == ("tiny",) and cfg.admin_token == "0123456789"
    assert cfg.load_slack is None and cfg.policy == "jsq"
    cfg = config_from_args(_args("--prefill", "http://p:1", "--decode", "http://d:1",
                                 "--load-slack", "0.1"))
    assert cfg.load_slack == 0.1 and cfg.policy == "eldr_cost"  # the default policy
    assert cfg.cost_layer_stride == 1  # every layer unless asked
    cfg = config_from_args(_args("--prefill", "http://p:1", "--decode", "http://d:1",
                                 "--cost-layer-stride", "3"))
    assert cfg.cost_layer_stride == 3
    assert cfg.http_front == "fast"  # the generate routes' fast front unless asked
    cfg = config_from_args(_args("--prefill", "http://p:1", "--decode", "http://d:1",
                                 "--http-front", "aiohttp"))
    assert cfg.http_front == "aiohttp"


def test_mixed_decode_specs_are_refused():
    with pytest.raises(ValueError, match="ids for all"):
        config_from_args(_args("--prefill", "http://p:1", "--decode", "a=http://d:1",
                               "--decode", "http://d:2"))


def test_eldr_policy_without_artifact_exits_2(capsys):
    assert main(["serve", "--prefill", "http://p:1", "--decode", "http://d:1",
                 "--policy", "eldr"]) == 2
    assert "needs a routing artifact" in capsys.readouterr().err


def test_a_missing_serve_extra_is_one_line_naming_it(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "prometheus_client" else real(name, *a))
    assert main(["serve", "--prefill", "http://p:1", "--decode", "http://d:1"]) == 2
    err = capsys.readouterr().err
    assert "needs prometheus_client" in err and "[serve]" in err and "Traceback" not in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _artifact_for_the_fake_engine(path) -> list[str]:
    """A real artifact of the fake engines' model (L=2, E=8) for one decoder ``e``."""
    from conftest import make_trace
    from eldr.fit.artifact import fit_artifact, save

    trace = make_trace(num_requests=8, num_layers=L, num_experts=E, top_k=2)
    save(fit_artifact(trace, worker_ids=["e"], n_init=1), path)
    return ["--artifact", str(path)]


@pytest.mark.parametrize("policy, with_artifact", [
    ("jsq", False), ("eldr_cost", False), ("eldr_cost", True)])
def test_serve_process_routes_reloads_on_sighup_and_stops_on_sigterm(policy, with_artifact,
                                                                     tmp_path):
    extra = _artifact_for_the_fake_engine(tmp_path / "art") if with_artifact else []

    async def go():
        eng = await FakeEngine("e").start()
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "eldr", "serve", "--prefill", eng.url, "--decode", eng.url,
             "--policy", policy, "--port", str(port), "--health-interval", "0.2",
             "--short-prompt-tokens", "0", *extra],
            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60  # a loaded CI machine imports slowly
            while time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                try:
                    status = await asyncio.to_thread(
                        lambda: urllib.request.urlopen(base + "/health", timeout=1).status)
                    break
                except OSError:
                    continue
            else:
                pytest.fail("eldr serve did not come up")
            req = urllib.request.Request(base + "/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "hi"}).encode())
            doc = await asyncio.to_thread(
                lambda: json.loads(urllib.request.urlopen(req, timeout=5).read()))
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.3)
            metrics = await asyncio.to_thread(
                lambda: urllib.request.urlopen(base + "/metrics", timeout=1).read().decode())
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            while proc.poll() is None and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.05)
            return status, doc, metrics, proc.returncode, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
            await eng.close()

    status, doc, metrics, rc, err = asyncio.run(go())
    assert status == 200
    assert doc["choices"][0]["text"] == "tok0tok1tok2"
    assert 'eldr_artifact_reloads_total{result="ok"} 1.0' in metrics
    decoder = "e" if with_artifact else "decode-0"
    assert f'eldr_routing_decisions_total{{decoder="{decoder}",policy="{policy}"}} 1.0' in metrics
    fallbacks = [ln for ln in metrics.splitlines()
                 if ln.startswith("eldr_routing_fallbacks_total{")]
    assert fallbacks and all(ln.endswith(" 0.0") for ln in fallbacks)  # eldr_cost bound first
    assert rc == 0, err
    assert "listening on http://127.0.0.1" in err


def test_admin_token_from_a_file_or_the_environment_never_the_command_line(tmp_path,
                                                                             monkeypatch,
                                                                             capsys):
    base = ("--prefill", "http://p:1", "--decode", "http://d:1", "--policy", "jsq")
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file-123\n")
    assert config_from_args(_args(*base, "--admin-token-file", str(token_file))).admin_token \
        == "from-the-file-123"
    monkeypatch.setenv("ELDR_ADMIN_TOKEN", "from-the-env-456")
    monkeypatch.setenv("ELDR_UPSTREAM_API_KEY", "engine-key")
    cfg = config_from_args(_args(*base))
    assert cfg.admin_token == "from-the-env-456" and cfg.upstream_api_key == "engine-key"
    assert "from-the-env" not in repr(cfg) and "engine-key" not in repr(cfg)
    monkeypatch.delenv("ELDR_ADMIN_TOKEN")
    assert config_from_args(_args(*base, "--admin-token", "on-the-command-line")).admin_token \
        == "on-the-command-line"
    assert "visible in the process list" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        config_from_args(_args(*base, "--admin-token-file", str(empty)))


def _get(url: str, token: str | None = None, data: bytes | None = None):
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=5) as resp:  # a new connection every call
        return resp.read()


def test_workers_share_the_port_the_loads_and_reloads(tmp_path):
    """--workers 2: both workers serve on one port, a load dispatched by one is seen by
    both, and an admin reload received by one reaches the other."""
    extra = _artifact_for_the_fake_engine(tmp_path / "art")
    token = "workers-token-123"

    async def go():
        pre, dec = await FakeEngine("p").start(), await FakeEngine("e").start()
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "eldr", "serve", "--prefill", pre.url, "--decode", dec.url,
             "--policy", "jsq", "--port", str(port), "--workers", "2",
             "--health-interval", "0.2", "--short-prompt-tokens", "0", *extra],
            stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "ELDR_ADMIN_TOKEN": token})
        base = f"http://127.0.0.1:{port}"
        out = {}
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                try:
                    await asyncio.to_thread(_get, base + "/health")
                    break
                except OSError:
                    continue
            else:
                pytest.fail("eldr serve --workers 2 did not come up")
            await asyncio.sleep(0.5)  # the second worker binds a moment later
            body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
            for _ in range(24):
                doc = json.loads(await asyncio.to_thread(_get, base + "/v1/completions",
                                                         None, body))
                assert doc["choices"][0]["text"] == "tok0tok1tok2"
            # each router process prefixes its upstream ids with its own random tag
            out["processes"] = {rid.rsplit("-", 1)[0] for rid in pre.request_ids}
            out["reload"] = json.loads(await asyncio.to_thread(
                _get, base + "/admin/reload", token, b""))
            await asyncio.sleep(0.5)  # the parent relays it to the other worker
            out["metrics"] = [(await asyncio.to_thread(_get, base + "/metrics")).decode()
                              for _ in range(16)]
            dec.mode = "hang"  # one decode stays in flight at decoder e
            hung = asyncio.ensure_future(asyncio.to_thread(
                lambda: urllib.request.urlopen(urllib.request.Request(
                    base + "/v1/completions", data=body, method="POST"), timeout=8)))
            await asyncio.sleep(0.5)
            out["loads"] = [json.loads(await asyncio.to_thread(_get, base + "/health"))
                            ["decode"][0]["load"] for _ in range(16)]
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            while proc.poll() is None and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.05)
            hung.cancel()
            return out, proc.returncode, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
            await pre.close()
            await dec.close()

    out, rc, err = asyncio.run(go())
    assert len(out["processes"]) == 2, out["processes"]  # served by both workers
    assert out["reload"]["reloaded"] is True
    for page in out["metrics"]:  # every worker reloaded exactly once
        assert 'eldr_artifact_reloads_total{result="ok"} 1.0' in page, page
    assert out["loads"] == [1.0] * 16  # both workers see the other's in-flight decode
    assert rc == 0, err
    assert "2 workers on http://127.0.0.1" in err


def test_decoders_come_from_decode_or_from_a_decoders_file(tmp_path):
    path = tmp_path / "decoders"
    path.write_text("# the decode pool\na=http://d:1\n\nb=http://d:2  # the second\n")
    cfg = config_from_args(_args("--prefill", "http://p:1", "--decoders-file", str(path),
                                 "--policy", "jsq"))
    assert cfg.decode_ids == ("a", "b") and cfg.decode_urls == ("http://d:1", "http://d:2")
    assert cfg.decoders_file == str(path)
    for argv in ((), ("--decode", "http://d:1", "--decoders-file", str(path))):
        with pytest.raises(ValueError, match="one of the two"):
            config_from_args(_args("--prefill", "http://p:1", *argv))


def test_decoder_slots_must_hold_the_decoders_given(capsys):
    assert main(["serve", "--prefill", "http://p:1", "--decode", "http://d:1", "--decode",
                 "http://d:2", "--policy", "jsq", "--workers", "2", "--decoder-slots",
                 "1"]) == 2
    assert "--decoder-slots must be in [2, 65536]" in capsys.readouterr().err


def test_serve_process_grows_over_http_and_follows_its_decoders_file_on_sighup(tmp_path):
    decoders = tmp_path / "decoders"
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    auth = {"Authorization": "Bearer s3cret-token"}

    async def go():
        pre, d0, d1, d2 = [await FakeEngine(n).start() for n in ("p", "d0", "d1", "d2")]
        decoders.write_text(f"a={d0.url}\n")
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "eldr", "serve", "--prefill", pre.url, "--decoders-file",
             str(decoders), "--policy", "jsq", "--port", str(port), "--health-interval",
             "0.2", "--admin-token-file", str(token)],
            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        base = f"http://127.0.0.1:{port}"

        def call(method, path, body=None):
            req = urllib.request.Request(base + path, method=method, headers=auth,
                                         data=None if body is None else json.dumps(body).encode())
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, json.loads(resp.read())

        def names():
            return [d["name"] for d in call("GET", "/admin/decoders")[1]["decoders"]]

        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                try:
                    await asyncio.to_thread(call, "GET", "/admin/decoders")
                    break
                except OSError:
                    continue
            else:
                pytest.fail("eldr serve did not come up")
            added = await asyncio.to_thread(call, "POST", "/admin/decoders", {"url": d1.url,
                                                                              "name": "b"})
            decoders.write_text(f"b={d1.url}\nc={d2.url}\n")  # a goes, c comes
            proc.send_signal(signal.SIGHUP)
            seen = []
            for _ in range(100):
                await asyncio.sleep(0.05)
                seen = await asyncio.to_thread(names)
                if seen == ["b", "c"]:
                    break
            served = [(await asyncio.to_thread(call, "POST", "/v1/completions",
                                               {"prompt": f"p{i}"}))[0] for i in range(4)]
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            while proc.poll() is None and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.05)
            return added, seen, served, proc.returncode, proc.stderr.read(), \
                len(d0.requests), len(d2.requests) + len(d1.requests)
        finally:
            if proc.poll() is None:
                proc.kill()
            for e in (pre, d0, d1, d2):
                await e.close()

    added, seen, served, rc, err, at_a, at_bc = asyncio.run(go())
    assert added[0] == 201 and [d["name"] for d in added[1]["decoders"]] == ["a", "b"]
    assert seen == ["b", "c"] and served == [200] * 4 and at_a == 0 and at_bc == 4
    assert "decoder c" in err and "drained and removed" in err and rc == 0, err
