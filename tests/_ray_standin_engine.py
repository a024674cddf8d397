"""A stand-in vLLM engine as a process (the Ray app's engine replicas start it in tests).

``python tests/_ray_standin_engine.py PORT NAME``: :class:`_proxy_fakes.FakeEngine` on
127.0.0.1:PORT until killed. Its prefill answers carry the eldr payload of the prompt's
expert counts (prompts mentioning "code" use experts 0-3, others 4-7).
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp.test_utils import TestServer

import _proxy_fakes


def main() -> None:
    port, name = int(sys.argv[1]), sys.argv[2]
    _proxy_fakes.TestServer = lambda app, port=0, **kw: TestServer(
        app, host="127.0.0.1", port=int(sys.argv[1]), **kw)

    async def serve() -> None:
        engine = _proxy_fakes.FakeEngine(name)
        engine.tokens = [f"{name}-tok{i}" for i in range(3)]
        await engine.start()
        await asyncio.Event().wait()

    del port
    asyncio.run(serve())


if __name__ == "__main__":
    main()
