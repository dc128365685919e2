"""The server's Prometheus metrics (GET /metrics)."""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """The server's Prometheus metrics (prometheus_client), in a registry of the server's own (tests run several)."""

    def __init__(self, server):
        self.registry = registry = CollectorRegistry()
        latency_buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.requests = Counter("nanochat_requests", "HTTP requests answered, by route and status (route \"other\": "
                                "an unknown path; \"(connection)\": answered by the connection's limits, 408 or 503; "
                                "499: the client left before its answer)", ["route", "status"], registry=registry)
        self.failed = Counter("nanochat_failed_generations", "Generations that failed (a 500, or an error event in a "
                              "stream already answered 200), by route", ["route"], registry=registry)
        self.write_timeouts = Counter("nanochat_write_timeouts", "Connections dropped because the client left an "
                                      "answer unread for --write_timeout seconds", registry=registry)
        self.refused_connections = Counter("nanochat_refused_connections", "Connections refused or cut off by their "
                                           "limits, by reason: max_connections, max_connections_per_client (503), "
                                           "header_timeout, read_timeout (408), bad_request (400), write_timeout "
                                           "(dropped)", ["reason"], registry=registry)
        self.busy = Counter("nanochat_busy_requests", "Requests answered 503 server_busy after --queue_timeout "
                            "seconds without a generation slot, by the cap that held them: max_concurrency or "
                            "max_concurrency_per_client", ["reason"], registry=registry)
        self.prompt_tokens = Counter("nanochat_prompt_tokens", "Prompt tokens of completion requests served",
                                     registry=registry)
        self.completion_tokens = Counter("nanochat_completion_tokens", "Tokens generated", registry=registry)
        self.latency = Histogram("nanochat_request_latency_seconds", "From a completion request's arrival (queue "
                                 "wait included) to its last token", buckets=latency_buckets, registry=registry)
        self.first_token = Histogram("nanochat_time_to_first_token_seconds", "From a completion request's arrival "
                                     "to its first token", buckets=latency_buckets, registry=registry)
        self.per_token = Histogram("nanochat_time_per_output_token_seconds", "A request's decode time per token after "
                                   "the first", buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
                                   registry=registry)
        self.steps = Histogram("nanochat_steps_per_token", "Supervision steps each generated token ran (fewer than "
                               "n_sup under halting)", buckets=range(1, server.most_steps + 1),
                               registry=registry)
        self.batch_requests = Histogram("nanochat_batch_requests", "Requests generating together in the batch, as "
                                        "each request joins it",
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=registry)
        Gauge("nanochat_queue_depth", "Completion requests waiting for a generation slot",
              registry=registry).set_function(lambda: server.waiting)
        Gauge("nanochat_running", "Generations running", registry=registry).set_function(lambda: server.running)

    def refused(self, status, reason):
        """An answer the connection gave itself (GuardedHTTP): 408, 503, 400; 0: dropped by the write deadline;
        reason: the limit that refused it."""
        self.refused_connections.labels(reason=reason).inc()
        if status:
            self.requests.labels(route="(connection)", status=str(status)).inc()
        else:
            self.write_timeouts.inc()

    def finished(self, job, n_sup, error=None, route="/v1/completions"):
        """Record a generation that ended (error: what failed it); n_sup: the steps each token ran when no halting
        rule was on; route: the one that started it."""
        if error is not None:
            self.failed.labels(route=route).inc()
        tokens = sum(len(choice.tokens) for choice in job.choices)
        self.prompt_tokens.inc(sum(len(ids) for ids in job.prompts))
        self.completion_tokens.inc(tokens)
        end = time.perf_counter()
        self.latency.observe(end - job.arrived)
        if job.first_at is not None:
            self.first_token.observe(job.first_at - job.arrived)
        if job.steps_done > 1:
            self.per_token.observe((job.last_at - job.first_at) / (job.steps_done - 1))
        steps = [s for row in job.stats.get("steps", ()) for s in row] or [n_sup] * tokens
        for s in steps:
            self.steps.observe(s)
