"""What a Monarch program imports from `monarch.config`: the runtime settings layer, with Monarch's names.

>>> from monarch_kernel.monarch.config import configure, configured, get_runtime_config
>>> with configured(stop_actor_timeout="5s"):
...     procs.stop().get()              # gives the actors' clean-up at most 5 s

Monarch's settings tune its Rust runtime (hyperactor): transports, acknowledgements, RDMA, telemetry.
Ours has its own runtime, so a setting does something here only where ours has the same knob:

- `stop_actor_timeout` (default "30s"): how long `ProcMesh.stop()` waits for the actors' `__cleanup__`
  (and their cancelled concurrent calls) before the processes end.

Every other name Monarch 0.7.0 knows is accepted and kept (so a program's set-up, and the snapshot and
restore of `configured`, work), and does nothing here: the guide's "Coming from Monarch" says so. A name
Monarch does not know raises ValueError, as Monarch's does. Durations are humantime strings ("500ms",
"30s", "5m", "1h 30m").
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from monarch_kernel.actors import procs

# the settings ours acts on: name -> default
_ACTED_ON: dict[str, Any] = {"stop_actor_timeout": f"{procs.STOP_ACTORS_S:.0f}s"}

# Monarch 0.7.0's other setting names (its hyperactor runtime's): accepted, kept, without effect here
_MONARCH_ONLY = frozenset("""
    actor_spawn_max_idle channel_net_rx_buffer_full_check_interval channel_reconnect_timeout
    channel_tcp_congestion channel_tcp_keepalive_idle cleanup_timeout codec_max_frame_length default_encoding
    default_transport enable_dest_actor_reordering_buffer enable_file_capture enable_log_forwarding
    enable_otel_metrics enable_otel_tracing enable_recorder_tracing enable_sqlite_tracing
    enable_unawaited_python_task_traceback file_log_level force_file_log forwarder_flush_timeout
    get_actor_state_max_idle get_proc_state_max_idle host_spawn_ready_timeout max_cast_dimension_size
    max_cast_fanout mesh_admin_addr mesh_admin_config_dump_bridge_timeout mesh_admin_max_concurrent_resolves
    mesh_admin_pyspy_bridge_timeout mesh_admin_pyspy_client_timeout mesh_admin_pyspy_max_profile_duration
    mesh_admin_pyspy_timeout mesh_admin_query_child_timeout mesh_admin_resolve_actor_timeout
    mesh_admin_single_host_timeout mesh_admin_tree_timeout mesh_attach_config_timeout
    mesh_bootstrap_enable_pdeathsig mesh_orphan_timeout mesh_proc_spawn_max_idle mesh_terminate_concurrency
    mesh_terminate_timeout message_ack_every_n_messages message_ack_time_interval message_delivery_timeout
    message_latency_sampling_rate message_ttl_default monarch_log_suffix otel_metric_export_interval
    pending_actor_delivery_timeout prefix_with_rank proc_launcher_kind proc_stop_max_idle
    process_exit_timeout process_memory_metric_interval pyspy_bin rdma_allow_tcp_fallback
    rdma_cq_poller_per_device rdma_disable_ibverbs rdma_host_odp rdma_ibverbs_target rdma_max_chunk_size_mb
    rdma_max_nics_per_buffer rdma_min_stripe_size_kb rdma_peer_device_affinity rdma_qp_init_timeout
    rdma_qps_per_cq rdma_qps_per_peer rdma_runtime_worker_threads rdma_tcp_fallback_parallelism read_log_buffer
    remote_alloc_allowed_port_range remote_alloc_bind_to_inaddr_any remote_alloc_bootstrap_addr
    scuba_log_enter_exit sequencer_max_locked_keys server_heartbeat_interval small_write_threshold
    split_max_buffer_age split_max_buffer_size stop_grace_period supervision_watchdog_timeout tail_log_lines
    terminated_snapshot_retention tokio_worker_threads use_direct_spawn
""".split())

_runtime: dict[str, Any] = {}  # the runtime layer: what configure() set
_DURATION_PART = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration_seconds(value: str | float) -> float:
    """Seconds of a humantime duration ("500ms", "30s", "1h 30m") or a number of seconds."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    text, total, at = str(value), 0.0, 0
    while at < len(text):
        match = _DURATION_PART.match(text, at)
        if match is None:
            raise ValueError(f"{value!r} is not a duration: write it as 500ms, 30s, 5m or 1h 30m")
        total += float(match.group(1)) * _UNIT_S[match.group(2)]
        at = match.end()
    if at == 0:
        raise ValueError(f"{value!r} is not a duration: write it as 500ms, 30s, 5m or 1h 30m")
    return total


def _apply() -> None:
    """Make the settings ours acts on take effect."""
    procs.STOP_ACTORS_S = duration_seconds(get_global_config()["stop_actor_timeout"])


def configure(**settings: Any) -> None:
    """Set runtime settings by Monarch's names (see the module's note for which act here)."""
    unknown = sorted(set(settings) - set(_ACTED_ON) - _MONARCH_ONLY)
    if unknown:
        raise ValueError(f"invalid configuration key: {', '.join(f'`{k}`' for k in unknown)} (Monarch 0.7.0's "
                         "names are accepted; see monarch_kernel.monarch.config)")
    for name, value in settings.items():
        if name in _ACTED_ON:
            duration_seconds(value)  # (checked before anything changes)
    _runtime.update(settings)
    _apply()


def get_runtime_config() -> dict[str, Any]:
    """A snapshot of the runtime layer: what configure() set (a copy)."""
    return dict(_runtime)


def get_global_config() -> dict[str, Any]:
    """The settings in effect: the defaults of those ours acts on, overlaid with the runtime layer."""
    return {**_ACTED_ON, **_runtime}


def clear_runtime_config() -> None:
    """Forget every setting configure() made (the defaults are back)."""
    _runtime.clear()
    _apply()


@contextlib.contextmanager
def configured(**settings: Any) -> Iterator[dict[str, Any]]:
    """Set these settings for the `with` block (yields the settings in effect); the earlier ones are back after."""
    before = get_runtime_config()
    configure(**settings)
    try:
        yield get_global_config()
    finally:
        _runtime.clear()
        _runtime.update(before)
        _apply()


__all__ = ["clear_runtime_config", "configure", "configured", "duration_seconds", "get_global_config",
           "get_runtime_config"]
