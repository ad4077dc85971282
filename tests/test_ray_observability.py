"""Ray's own observability is off in the processes a cluster starts (cluster.deploy.ray_start): the
serving process pays for no task-event reports nor Ray metrics it never reads, unless the
environment asks for them."""

from __future__ import annotations

from cluster.deploy.ray_start import RAY_OBSERVABILITY_OFF, without_ray_observability


def test_task_events_and_ray_metrics_are_off_unless_the_environment_sets_them():
    environ = {"RAY_enable_metrics_collection": "1", "HOME": "/root"}
    without_ray_observability(environ)
    assert environ == {
        "RAY_task_events_report_interval_ms": "0",  # no TaskEventBuffer in the core worker
        "RAY_enable_metrics_collection": "1",  # asked for: kept
        "HOME": "/root",
    }
    assert set(RAY_OBSERVABILITY_OFF) == {
        "RAY_task_events_report_interval_ms",
        "RAY_enable_metrics_collection",
    }
