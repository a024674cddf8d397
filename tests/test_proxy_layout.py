"""One completion request traced from the HTTP handler to the decoder's stream: the ``eldr``
modules it crosses (``eldr.routing`` aside: the policies are the decision itself), and the
same lists in docs/serve.md's "Code layout", so the page cannot drift from the code.

A module the request *passes through* hands work on to another ``eldr`` module while it
serves the request; a module it only *asks* answers and returns. The request path is
clear when few modules pass it on, and when none of them is the control side or the
multi-process mode."""

import asyncio
import importlib.util
import re
import sys
from pathlib import Path

from _proxy_fakes import cluster, run

DOCS = Path(__file__).resolve().parent.parent / "docs" / "serve.md"
# modules that hand one request on, handler to decoder stream: the attempt loop and its
# three legs (prefill, decoder choice, decode relay) are one module each
MAX_PASSES = 10
# the HTTP client's modules run only with httptools (the serve extra installs it)
CLIENT = {"eldr.proxy.engines.client", "eldr.proxy.engines.connection"}


def _module(frame) -> str | None:
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name if name.startswith("eldr.") and not name.startswith("eldr.routing") else None


def _trace_one_stream() -> tuple[set[str], set[str]]:
    """(modules crossed, modules that passed the request on) of one streamed completion
    through a router with the default policy (eldr_cost), one prefill and two decoders."""
    async def go():
        async with cluster(policy="eldr_cost", health_interval=30.0) as (_r, client, _p, _d):
            body = {"model": "tiny", "prompt": "write code now", "stream": True}
            await (await client.post("/v1/completions", json=body)).read()  # warm: caches
            calls = []  # (task, module, calling module) of every eldr call

            def record(frame, event, arg):
                if event == "call" and (mod := _module(frame)) is not None:
                    try:
                        task = asyncio.current_task()
                    except RuntimeError:  # a callback outside the loop's tasks
                        task = None
                    calls.append((task, mod, _module(frame.f_back), frame.f_code.co_name))

            sys.setprofile(record)
            try:
                await (await client.post("/v1/completions", json=body)).read()
            finally:
                sys.setprofile(None)
            return calls

    calls = run(go())
    # the handler's task, and the client connection's callbacks (no task); not the stand-in
    # engines' handlers (tasks of their own) nor the router's background work
    handler = {t for t, mod, _, fn in calls if mod == "eldr.proxy.app" and fn == "generate"}
    assert len(handler) == 1
    mine = [(mod, caller) for t, mod, caller, _ in calls if t in handler or t is None]
    crossed = {mod for mod, _ in mine}
    passes = {caller for mod, caller in mine if caller is not None and caller != mod}
    return crossed, passes


def _documented() -> dict[str, set[str]]:
    """role ("passes it on" / "asked") -> the modules docs/serve.md's table gives it."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("## Code layout"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\| `(eldr\.[\w.]+)` \|[^|\n]*\| (passes it on|asked) \|$", section,
                      re.M)
    out: dict[str, set[str]] = {"passes it on": set(), "asked": set()}
    for mod, role in rows:
        out[role].add(mod)
    return out


def test_one_request_crosses_the_modules_the_docs_list():
    crossed, passes = _trace_one_stream()
    doc = _documented()
    if importlib.util.find_spec("httptools") is None:  # aiohttp's client instead
        doc = {role: mods - CLIENT for role, mods in doc.items()}
    assert passes == doc["passes it on"], "docs/serve.md#code-layout: update the table"
    assert crossed - passes == doc["asked"], "docs/serve.md#code-layout: update the table"
    assert len(passes) <= MAX_PASSES, sorted(passes)
    # the request path touches neither the control side nor the multi-process mode
    assert not {m for m in crossed if m.startswith(("eldr.proxy.control",
                                                    "eldr.proxy.workers"))}


def test_the_docs_table_parses():
    doc = _documented()
    assert "eldr.proxy.app" in doc["passes it on"] and "eldr.proxy.metrics" in doc["asked"]
    assert not doc["passes it on"] & doc["asked"]
