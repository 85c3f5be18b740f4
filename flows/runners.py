"""Where batches run: threads (default), a process pool (all cores), Dask or Ray (many machines)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, get_args

from prefect.context import FlowRunContext
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from rollout_capture.enrich_options import Runner
from rollout_capture.filesystem import is_local

REMOTE: tuple[Runner, ...] = ("dask", "ray")
"""Runners whose batches may run on other machines: they get the batch's bytes, not a local slice."""


LOCAL_THREADS = 2
SHARED_READS_WORKERS = 2
"""Threads for a job whose batches all read one journal on an object store (``flows.enrich``)."""


def effective_workers(runner: Runner, max_workers: int, capture_dir: str) -> int:
    """How many batches to run at once.

    Threads only help while batches wait on storage: on a local disk, beyond two they
    add memory and interpreter-lock contention, never speed. The process pool gets one
    worker per core at most; Dask and Ray take ``max_workers`` as given.
    """
    local = is_local(capture_dir)
    if runner == "processes":
        return min(max_workers, os.cpu_count() or 1)
    return min(max_workers, LOCAL_THREADS) if runner == "threads" and local else max_workers


def check_runner(runner: str, dask_address: str | None = None, ray_address: str | None = None) -> None:
    """Refuse an unknown runner, or a cluster address given for another runner (a mix-up)."""
    if runner not in get_args(Runner):
        raise ValueError(f"runner must be one of {', '.join(get_args(Runner))}; got {runner!r}")
    if dask_address and runner != "dask":
        raise ValueError(f"dask_address is for runner='dask'; runner is {runner!r}")
    if ray_address and runner != "ray":
        raise ValueError(f"ray_address is for runner='ray'; runner is {runner!r}")


def make_task_runner(
    runner: Runner, max_workers: int, dask_address: str | None = None, ray_address: str | None = None
) -> TaskRunner[Any]:
    """A task runner for the batches; process pools spawn (filesystems are not fork-safe)."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be at least 1; got {max_workers}")
    check_runner(runner, dask_address, ray_address)
    if runner == "threads":
        return ThreadPoolTaskRunner(max_workers=max_workers)
    if runner == "processes":  # task runs in threads here; their merges in a worker pool
        return ThreadPoolTaskRunner(max_workers=max_workers)
    if runner == "ray":
        return _ray_task_runner(ray_address)
    try:
        from prefect_dask.task_runners import DaskTaskRunner
    except ImportError as exc:
        raise ValueError("runner='dask' needs prefect-dask: pip install 'rollout-capture[dask]'") from exc
    if dask_address:
        return DaskTaskRunner(address=dask_address)
    workers = min(max_workers, os.cpu_count() or 1)
    return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True})


_ray_lock = threading.Lock()
_ray_users = 0
_ray_address: str | None = None
_ray_opened = False


def _ray_task_runner(address: str | None) -> TaskRunner[Any]:
    """A RayTaskRunner on this process's one Ray connection (see :func:`_ray_connection`)."""
    try:
        from prefect_ray.task_runners import RayTaskRunner
    except ImportError as exc:
        raise ValueError("runner='ray' needs prefect-ray: pip install 'rollout-capture[ray]'") from exc

    class SharedRayTaskRunner(RayTaskRunner):  # type: ignore[misc]  # prefect-ray is untyped
        """Enters this process's shared Ray connection, so it never owns (and shuts down) Ray."""

        def __enter__(self) -> SharedRayTaskRunner:
            self._connection = _ray_connection(self.address)
            self._connection.__enter__()
            try:
                super().__enter__()
            except BaseException:
                self._connection.__exit__(None, None, None)
                raise
            return self

        def __exit__(self, *exc_info: Any) -> None:
            try:
                super().__exit__(*exc_info)
            finally:
                self._connection.__exit__(None, None, None)

        def duplicate(self) -> SharedRayTaskRunner:
            return SharedRayTaskRunner(address=self.address, init_kwargs=self.init_kwargs)

        _run_prefect_task = staticmethod(_run_on_ray_worker)

    return SharedRayTaskRunner(address=address)


def _run_on_ray_worker(*upstream: Any, **options: Any) -> Any:
    """prefect-ray's task body on a Ray worker, then what it queued for the API sent, then its result.

    Ray ends a job's worker processes as soon as its driver disconnects (the flow run is
    over, a failed batch ends it at once): a task run's last states and logs still queued
    there would never reach the UI.
    """
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect_ray.task_runners import RayTaskRunner

    try:
        return RayTaskRunner._run_prefect_task(*upstream, **options)
    finally:
        for service in (EventsWorker, APILogWorker):
            service.drain_all(timeout=10, at_exit=False)


@contextmanager
def _ray_connection(address: str | None) -> Iterator[None]:
    """One Ray driver per process, shared by the runs that use it at the same time.

    Ray allows one connection per process, and prefect-ray's runner shuts down the one it
    opened when its flow run ends, under the feet of the scheduled job's other runs still
    using it. The connection opens with the first user and closes with the last; two
    clusters at once in one process are refused. A connection the caller made (a flow
    called from an RL job's Ray driver) is used as it is and left open. No address:
    ``RAY_ADDRESS``, else a local Ray instance for the run.
    """
    import ray

    global _ray_users, _ray_address, _ray_opened
    with _ray_lock:
        if _ray_users and address != _ray_address:
            raise ValueError(
                f"this process is using the Ray cluster at {_ray_address or 'local'}; "
                f"one Ray cluster per process, not also {address or 'a local one'}"
            )
        if not _ray_users:
            _ray_opened = not ray.is_initialized()
            if _ray_opened:
                ray.init(address=address, namespace="prefect", log_to_driver=False)
        _ray_users += 1
        _ray_address = address
    try:
        yield
    finally:
        with _ray_lock:
            _ray_users -= 1
            if not _ray_users and _ray_opened and ray.is_initialized():
                ray.shutdown()


def current_api_url() -> str | None:
    """The API this process talks to: the configured one, else (in a flow run on the embedded
    temporary server) the one the run's own client reports to; None outside any run."""
    configured = PREFECT_API_URL.value()
    if configured:
        return str(configured)
    context = FlowRunContext.get()
    return str(context.client.api_url).rstrip("/") if context is not None else None


@contextmanager
def api_shared_with_workers(runner: Runner) -> Iterator[None]:
    """Let batches running in other processes report to this process's API.

    Workers get the settings of the submitting context; without an explicit URL there
    (the embedded temporary server), each worker would boot a server of its own: seconds
    lost per worker, and task runs the UI of this flow run would never show.
    """
    url = current_api_url() if runner in REMOTE and not PREFECT_API_URL.value() else None
    if url is None:
        yield
        return
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield
