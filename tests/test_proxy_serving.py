"""eldr.proxy.serving: the one serve loop of eldr serve (and its workers) and eldr
orchestrate: listening, the banner, ready(port), SIGHUP, SIGTERM and the clean-up."""

import asyncio
import os
import signal
import socket

import pytest

pytest.importorskip("aiohttp")

from aiohttp import web

from eldr.proxy.serving import run_app


def _connectable(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_loop_listens_says_so_hangs_up_and_stops_on_sigterm(capsys):
    async def hello(request):
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/", hello)
    hangups, events = [], []

    async def on_hangup():
        hangups.append(1)

    async def go():
        port = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(run_app(
            web.AppRunner(app), host="127.0.0.1", port=0, ready=port.set_result,
            banner=lambda host, p: f"test: listening on {host}:{p}", on_hangup=on_hangup))
        p = await asyncio.wait_for(port, 30)
        events.append(("open", _connectable(p)))
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100):
            if hangups:
                break
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(task, 30)  # returns: stopped, not killed
        events.append(("closed", not _connectable(p)))
        return p

    port = asyncio.run(go())
    assert port > 0 and events == [("open", True), ("closed", True)]
    assert hangups == [1]
    assert f"test: listening on 127.0.0.1:{port}" in capsys.readouterr().err


def test_without_a_hangup_handler_sighup_is_left_alone():
    async def go():
        seen = []
        previous = signal.signal(signal.SIGHUP, lambda *_: seen.append("ours"))
        try:
            port = asyncio.get_running_loop().create_future()
            task = asyncio.ensure_future(run_app(
                web.AppRunner(web.Application()), host="127.0.0.1", port=0,
                ready=port.set_result, banner=lambda h, p: "test"))
            await asyncio.wait_for(port, 30)
            os.kill(os.getpid(), signal.SIGHUP)
            await asyncio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.wait_for(task, 30)
        finally:
            signal.signal(signal.SIGHUP, previous)
        return seen

    assert asyncio.run(go()) == ["ours"]
