"""A stand-in vLLM engine as a process (the Ray app's engine replicas start it in tests).

``python tests/_ray_standin_engine.py PORT NAME``: :class:`_proxy_fakes.FakeEngine` on
127.0.0.1:PORT until killed. Its prefill answers carry the eldr payload of the prompt's
expert counts (prompts mentioning "code" use experts 0-3, others 4-7). A streamed decode
of a prompt mentioning "slowly" sends 200 tokens, one each 50 ms (a client can leave
in the middle).
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp.test_utils import TestServer

import _proxy_fakes


class StandIn(_proxy_fakes.FakeEngine):
    async def _stream(self, request, body, n_prompt):
        if "slowly" not in _proxy_fakes._prompt_of(body):
            return await super()._stream(request, body, n_prompt)
        saved = self.tokens, self.mode
        self.tokens, self.mode = [f"s{i}" for i in range(200)], "slow"
        try:
            return await super()._stream(request, body, n_prompt)
        finally:
            self.tokens, self.mode = saved


def main() -> None:
    port, name = int(sys.argv[1]), sys.argv[2]
    _proxy_fakes.TestServer = lambda app, port=0, **kw: TestServer(
        app, host="127.0.0.1", port=int(sys.argv[1]), **kw)

    async def serve() -> None:
        engine = StandIn(name)
        engine.tokens = [f"{name}-tok{i}" for i in range(3)]
        await engine.start()
        await asyncio.Event().wait()

    del port
    asyncio.run(serve())


if __name__ == "__main__":
    main()
