"""An opt-in Prometheus endpoint for run operators: ``[metrics] port`` in the volunteer's
settings (``protocol.settings``; 0, the default, serves nothing).

The node's counters are read when Prometheus scrapes (a collector over ``Node.stats``), so
training pays nothing between scrapes. The endpoint listens on ``metrics.address``
(127.0.0.1 by default: a volunteer's numbers stay on the machine unless they open it up).
A port that cannot be bound is logged and the node trains on without it.

    swarmstream_node_info{run, peer, client}          1
    swarmstream_tokens_total                          tokens trained by this process
    swarmstream_tokens_per_second                     of training time (pauses left out)
    swarmstream_inner_steps_total
    swarmstream_inner_step_seconds                    median of the latest 50 steps
    swarmstream_blocked_seconds_total{on}             "sync": at a landing, on a result; "checks": between steps
    swarmstream_paused_seconds_total
    swarmstream_syncs_total{outcome}                  "ok", "alone" (no group), "failed"
    swarmstream_bytes_total{direction}                "sent", "received" (averaging streams)
    swarmstream_peers                                 other peers (fresh heartbeats; a large run's estimate)
    swarmstream_step, swarmstream_round               inner step counter; fragments' lowest completed round
    swarmstream_train_loss, swarmstream_heldout_loss  latest (absent until measured)
    swarmstream_banned_peers                          banned for a proven lie
    swarmstream_audits_total{verdict}                 our audits of other reducers' means: "ok", "wrong"
                                                      (proven, banned), "unproven" (inputs not shown)
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from protocol import __version__

log = logging.getLogger("peer.node")


class _NodeCollector:
    """The node's figures, read at each scrape (from the HTTP server's thread: only reads of
    numbers and copies of deques, which the GIL keeps whole)."""

    def __init__(self, node: Any):
        self.node = node

    def collect(self):
        n, s = self.node, self.node.stats
        info = InfoMetricFamily("swarmstream_node", "This node: its run, peer ID and client")
        info.add_metric([], {"run": n.signed.run_id_text, "peer": n.identity.peer_id,
                             "client": f"swarmstream/{__version__}"})
        yield info
        yield _counter("swarmstream_tokens", "Tokens trained by this process", s.tokens)
        yield _gauge("swarmstream_tokens_per_second", "Tokens per second of training time (pauses left out)",
                     n._tokens_per_s())
        yield _counter("swarmstream_inner_steps", "Inner steps trained by this process", s.inner_steps)
        steps = list(s.step_times)
        if steps:
            yield _gauge("swarmstream_inner_step_seconds", "Median time of the latest inner steps",
                         statistics.median(steps))
        blocked = CounterMetricFamily("swarmstream_blocked_seconds",
                                      "Training blocked on the swarm: at a landing on a sync's result, or between steps",
                                      labels=["on"])
        blocked.add_metric(["sync"], s.waited_s)
        blocked.add_metric(["checks"], s.checks_s)
        yield blocked
        yield _counter("swarmstream_paused_seconds", "Time paused (by the volunteer or the schedule)", s.paused_s)
        syncs = CounterMetricFamily("swarmstream_syncs", "Fragment syncs by outcome", labels=["outcome"])
        syncs.add_metric(["ok"], s.syncs - s.syncs_alone)
        syncs.add_metric(["alone"], s.syncs_alone - s.syncs_failed)
        syncs.add_metric(["failed"], s.syncs_failed)
        yield syncs
        traffic = CounterMetricFamily("swarmstream_bytes", "Bytes of the averaging streams", labels=["direction"])
        traffic.add_metric(["sent"], s.bytes_sent)
        traffic.add_metric(["received"], s.bytes_received)
        yield traffic
        yield _gauge("swarmstream_peers", "Other peers of the run: those with a fresh heartbeat, or in a "
                     "large run the estimate from the shards read (peer.shards)", n._run_size() - 1)
        if n.worker is not None:
            yield _gauge("swarmstream_step", "The inner step counter", n.worker.step)
        yield _gauge("swarmstream_round", "The lowest completed outer round over the fragments",
                     min(s.rounds, default=0))
        for name, series in (("train", s.losses), ("heldout", s.heldout)):
            latest = list(series)[-1:]
            if latest:
                yield _gauge(f"swarmstream_{name}_loss", f"Latest {name} loss", latest[0][1])
        yield _gauge("swarmstream_banned_peers", "Peers banned from the run for a proven lie",
                     len(n.bans) if n.bans is not None else 0)
        if (audits := getattr(n.averager, "audits", None)) is not None:
            verdicts = CounterMetricFamily("swarmstream_audits", "Our audits of other reducers' means, by verdict",
                                           labels=["verdict"])
            for verdict in ("ok", "wrong", "unproven"):
                verdicts.add_metric([verdict], audits.counts[verdict])
            yield verdicts


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class MetricsServer:
    """The endpoint, for the life of a node; ``close`` stops it."""

    def __init__(self, node: Any, address: str, port: int):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_NodeCollector(node))
        self._server = None
        try:
            self._server, _ = start_http_server(port, addr=address, registry=self.registry)
        except OSError as e:
            log.warning("metrics endpoint not started on %s:%d (%s); set metrics.port to a free port, or 0",
                        address, port, e.strerror or e)
            return
        log.info("metrics at http://%s:%d/metrics", address, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
