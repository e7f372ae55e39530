"""Prometheus metrics of the serving process, served as ``/metrics`` on the HTTP port.

Request latencies are observed when a request finishes; instance gauges (queues, KV use) are
read from the instances when the endpoint is scraped, so they are never stale by more than a
scrape; so are role changes (a counter per instance and direction, and their durations) and the
role controller's verdicts (a counter per verdict: proposed, recalled, held by memory, proposed
layout did no better, forecast, forecast overruled by memory). Each
server has its own registry, so several can run in one process (tests)."""

from __future__ import annotations

import contextlib
import itertools
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from distserve.cluster.instance import InstanceInfo
from distserve.cluster.role_changes import RoleChangeRecord
from distserve.core.outputs import RequestOutput
from distserve.core.role import ROLES
from distserve.kv_tier.store import TierInfo

if TYPE_CHECKING:
    from distserve.entrypoints.api_servers import ApiServerStatus

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServingMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"distserve_{name}", doc, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"distserve_{name}", doc, labels, registry=registry)

        def instance_gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"distserve_instance_{name}", doc, ["instance", "role"], registry=registry)

        self.ttft = histogram("time_to_first_token_seconds", "arrival to first token")
        self.tpot = histogram(
            "time_per_output_token_seconds", "mean time per output token after the first", _TOKEN_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "arrival to last token")
        self.queue_time = histogram("request_queue_time_seconds", "arrival to the start of its prefill batch")
        self.migration_time = histogram(
            "kv_migration_seconds", "time to pull a request's KV cache from prefill to decode"
        )
        self.requests = counter("requests", "finished requests", ("finish_reason",))
        self.errors = counter("request_errors", "refused or failed requests", ("code",))
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "output tokens of finished requests")
        self.migrations = counter("kv_migrations", "KV caches moved from prefill to decode")
        self.local_prefills = counter("local_prefills", "requests their decode instance prefilled itself")
        self.pending = Gauge("distserve_pending_requests", "requests admitted and not finished", registry=registry)
        server = ["server"]
        self.server_pending = Gauge("distserve_api_server_pending_requests", "requests in flight through an API server",
                                    server, registry=registry)  # fmt: skip
        self.server_cpu = Gauge("distserve_api_server_cpu_seconds", "an API server process's user + system CPU time",
                                server, registry=registry)  # fmt: skip
        self.server_restarts = Gauge("distserve_api_server_restarts", "times an API server was started again",
                                     server, registry=registry)  # fmt: skip
        self.waiting = instance_gauge("waiting_requests", "requests queued")
        self.running = instance_gauge("running_requests", "requests in the batch")
        self.held = instance_gauge("held_requests", "prefilled requests whose KV waits to be pulled")
        self.kv_usage = instance_gauge("kv_cache_usage", "share of KV blocks in use")
        # Labelled with what the blocks store, as vLLM's cache_config_info carries its cache_dtype.
        self.kv_blocks = Gauge("distserve_instance_kv_cache_blocks", "KV blocks of the instance's cache",
                               ["instance", "role", "kv_cache_dtype"], registry=registry)  # fmt: skip
        self.preemptions = instance_gauge("preemptions", "requests preempted since start")
        self.swapped = instance_gauge("swapped_requests", "preempted requests whose KV is in the host pool")
        self.swap_outs = instance_gauge("swap_outs", "preempted requests whose KV was copied to the host pool")
        self.swap_ins = instance_gauge("swap_ins", "swapped requests whose KV was copied back")
        self.swap_seconds = instance_gauge("swap_seconds", "seconds the copies to and from the host pool took")
        self.healthy = instance_gauge("healthy", "1 while the instance serves")
        # Gauges read straight off an InstanceInfo field: (gauge, field).
        self._counts = [
            (self.swapped, "num_swapped"),
            (self.swap_outs, "num_swap_outs"),
            (self.swap_ins, "num_swap_ins"),
            (self.swap_seconds, "swap_seconds"),
            (instance_gauge("prompt_tokens", "prompt tokens to prefill since start (recomputes too)"), "prompt_tokens"),
            (instance_gauge("cached_prompt_tokens", "of those, found cached (prefix cache or tier)"),
             "cached_prompt_tokens"),
            (instance_gauge("tier_hit_tokens", "of those, found in the prefix tier: prefill tokens it saved"),
             "tier_hit_tokens"),
            (instance_gauge("tier_loaded_blocks", "KV blocks copied in from the prefix tier"), "tier_loaded_blocks"),
            (instance_gauge("tier_saved_blocks", "KV blocks copied out to the prefix tier"), "tier_saved_blocks"),
            (instance_gauge("kv_checksum_mismatches", "KV pulls whose received KV differed from what was sent "
                            "(each failed; its request ran again)"), "num_kv_checksum_mismatches"),
        ]  # fmt: skip

        def tier_gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"distserve_kv_tier_{name}", doc, ["node"], registry=registry)

        self._tier = [
            (tier_gauge("capacity_blocks", "KV blocks the node's prefix tier holds at most"), "capacity_blocks"),
            (tier_gauge("entries", "KV blocks in the node's prefix tier"), "num_entries"),
            (tier_gauge("bytes_per_block", "bytes of one block of the whole model's KV"), "bytes_per_block"),
            (tier_gauge("queried_blocks", "blocks looked up since start"), "queried_blocks"),
            (tier_gauge("hit_blocks", "of those, found"), "hit_blocks"),
            (tier_gauge("remote_hit_blocks", "of those, copied from another node's tier"), "remote_hit_blocks"),
            (tier_gauge("written_blocks", "blocks saved since start"), "written_blocks"),
            (tier_gauge("evicted_blocks", "blocks evicted since start, least recently used first"), "evicted_blocks"),
        ]
        pair = ["instance", "source", "transport"]
        self.kv_pulls = Gauge("distserve_kv_pulls", "KV pulls of a decode instance, by prefill instance", pair,
                              registry=registry)  # fmt: skip
        self.kv_pull_bytes = Gauge("distserve_kv_pull_bytes", "bytes those pulls moved", pair, registry=registry)
        self.kv_pull_seconds = Gauge("distserve_kv_pull_seconds", "time those pulls took", pair, registry=registry)
        self.role_changes = counter("role_changes", "instances' role changes", ("instance", "old_role", "new_role"))
        self.role_change_time = histogram("role_change_seconds", "asked to serving the new role")
        self._num_role_changes = 0  # of the cluster's history, observed already
        self.role_verdicts = counter("role_controller_verdicts", "role controller judgements, by verdict", ("verdict",))
        self._verdicts: dict[str, int] = {}  # the controller's counts, observed already

    def observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        self.requests.labels(output.finish_reason).inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(output.num_output_tokens)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if len(m.token_times) > 1:  # a request of one token has no decode phase to time
            self.tpot.observe(m.tpot)
        if m.arrival_time is not None and m.token_times:
            self.e2e.observe(m.token_times[-1] - m.arrival_time)
        if m.arrival_time is not None and m.prefill_start is not None:
            self.queue_time.observe(max(0.0, m.prefill_start - m.arrival_time))
        if m.local_prefill:
            self.local_prefills.inc()
        if m.migration_start is not None and m.migration_end is not None:
            self.migrations.inc()
            self.migration_time.observe(m.migration_end - m.migration_start)

    def observe_error(self, code_name: str) -> None:
        self.errors.labels(code_name).inc()

    def update_api_servers(self, statuses: list[ApiServerStatus]) -> None:
        """The cluster's API servers as the first sees them (another server: itself alone)."""
        for status in statuses:
            label = str(status.index)
            self.server_pending.labels(label).set(status.num_pending_requests)
            self.server_cpu.labels(label).set(status.cpu_seconds)
            self.server_restarts.labels(label).set(status.restarts)

    def update_instances(
        self,
        infos: list[InstanceInfo],
        num_pending: int,
        role_changes: list[RoleChangeRecord],
        role_verdicts: dict[str, int],
        tiers: list[TierInfo] = (),
    ) -> None:
        self.pending.set(num_pending)
        for tier in tiers:
            for gauge, name in self._tier:
                gauge.labels(tier.node_id).set(getattr(tier, name))
        for verdict, count in role_verdicts.items():
            self.role_verdicts.labels(verdict).inc(count - self._verdicts.get(verdict, 0))
        self._verdicts = dict(role_verdicts)
        for record in role_changes[self._num_role_changes :]:
            if record.error is None:
                self.role_changes.labels(record.instance, record.old_role, record.new_role).inc()
                self.role_change_time.observe(record.seconds)
        self._num_role_changes = len(role_changes)
        counts = [gauge for gauge, _ in self._counts]
        gauges = (self.waiting, self.running, self.held, self.kv_usage, self.preemptions, self.healthy, *counts)
        for info in infos:
            labels = (info.name, info.role)
            left = [role for role in ROLES if role != info.role]  # the series of roles it left, if any
            stale = [(gauge, (info.name, role)) for gauge, role in itertools.product(gauges, left)]
            stale += [(self.kv_blocks, (info.name, role, info.kv_cache_dtype)) for role in left]
            for gauge, series in stale:
                with contextlib.suppress(KeyError):
                    gauge.remove(*series)
            self.kv_blocks.labels(*labels, info.kv_cache_dtype).set(info.num_blocks)
            self.waiting.labels(*labels).set(info.num_waiting)
            self.running.labels(*labels).set(info.num_running)
            self.held.labels(*labels).set(info.num_held)
            self.kv_usage.labels(*labels).set(1.0 - info.num_free_blocks / info.num_blocks)
            self.preemptions.labels(*labels).set(info.num_preemptions)
            for gauge, name in self._counts:
                gauge.labels(*labels).set(getattr(info, name))
            self.healthy.labels(*labels).set(0 if info.failure else 1)
            for source, totals in info.kv_pulls_from.items():
                pair = (info.name, source, totals.transport)
                self.kv_pulls.labels(*pair).set(totals.pulls)
                self.kv_pull_bytes.labels(*pair).set(totals.num_bytes)
                self.kv_pull_seconds.labels(*pair).set(totals.seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
