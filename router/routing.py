"""Cache-aware routing: which P prefills a prompt, which D decodes it, and whether P is needed.

`CacheRouting` keeps the KV index (`kv_index.py`) fed from two kinds of streams per engine:

* vLLM's own KV events (its prefix cache), a ZeroMQ PUB socket per engine that the router
  subscribes to (`--kv-events-config` on the engine; `kvbaton serve` sets it);
* each P sidecar's history residency, pulled with the authenticated `Residency` peer call.

For a request it tokenizes the prompt with the served tokenizer, hashes its full blocks as the
engines do, and picks D then P with `kv_index.choose` (longest resident prefix, weighed against
requests in flight, round robin when nothing is known). When the chosen D already holds at least
`disaggregate_below` of the prompt, P is skipped: D computes the short rest itself.

Every frame from the network is bounded before it is decoded; refusals are counted by source and
reason and shown in the router's /metrics (`kvbaton_router_kv_events_refused`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .kv_index import (CACHE, HISTORY_CPU, HISTORY_GPU, MAX_BATCH_BYTES, Choice, KvIndex, PrefixHasher,
                       Refusal, choose)

logger = logging.getLogger("kvbaton.router.routing")

ROUTING_MODES = ("cache-aware", "round-robin")
# How often each P sidecar is asked for its history's changes.
RESIDENCY_POLL_S = 0.25
# Prompts longer than this many characters are not tokenized for routing (fallback choice).
MAX_TOKENIZE_CHARS = 4 << 20


@dataclass
class RoutingConfig:
    mode: str = "cache-aware"
    block_size: int = 32
    hash_algo: str = "sha256"
    hash_seed: str | None = None  # None: $PYTHONHASHSEED, else vLLM's default seed
    tokenizer: str | None = None  # the served tokenizer (a path or hub name)
    # D alone when it holds at least this fraction of the prompt; above 1: always disaggregate.
    disaggregate_below: float = 0.5
    # One request in flight ahead costs this share of a prompt's cached prefix.
    load_weight: float = 0.1
    kv_events: dict[str, str] = field(default_factory=dict)  # engine URL -> its vLLM KV events endpoint
    controls: dict[str, str] = field(default_factory=dict)  # P URL -> its sidecar's router door (router_door.py)

    def __post_init__(self) -> None:
        if self.mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, not {self.mode!r}")
        if not 0.0 <= self.disaggregate_below:
            raise ValueError(f"disaggregate_below must be >= 0, not {self.disaggregate_below}")
        if self.load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, not {self.load_weight}")


@dataclass
class Pick:
    p_url: str | None  # None: D alone
    d_url: str
    how: str  # how P was chosen: round_robin, cache, load, fallback, session ("none" with D alone)
    tokens: int = 0  # prompt tokens the router counted (0: not tokenized)
    p_blocks: int = 0
    d_blocks: int = 0
    session: object = None  # the agent session it is a turn of (router/sessions.py SessionAsk)
    resume: bool = False  # an earlier turn of that session went to this P


class CacheRouting:
    def __init__(self, config: RoutingConfig, prefill_urls: list[str], decode_urls: list[str]) -> None:
        self.config = config
        self.prefill_urls = prefill_urls
        self.decode_urls = decode_urls
        self.hasher = PrefixHasher(config.block_size, config.hash_algo, config.hash_seed)
        self.index = KvIndex(config.block_size, self.hasher)
        self.in_flight: dict[str, int] = {u: 0 for u in prefill_urls + decode_urls}
        self.controls = {u.rstrip("/"): a for u, a in config.controls.items()}
        # How to ask a P sidecar for its residency (the router's door, set by the router): None
        # until the router holds a router key.
        self.call_sidecar = None
        self._rr_p = 0
        self._rr_d = 0
        self.tokenizer = None
        self.tokenizer_error = ""
        self.feed_errors: dict[tuple[str, str], int] = {}
        self.token_mismatches = 0
        self._tasks: list[asyncio.Task] = []
        self._history_tasks: dict[str, asyncio.Task] = {}
        self._zmq = None
        if config.mode == "cache-aware":
            self._load_tokenizer()

    @property
    def cache_aware(self) -> bool:
        return self.config.mode == "cache-aware"

    def _load_tokenizer(self) -> None:
        if not self.config.tokenizer:
            self.tokenizer_error = "no tokenizer configured"
            logger.warning("cache-aware routing without a tokenizer: only prompts given as token ids "
                           "are routed by cache (pass --tokenizer or --model)")
            return
        try:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer)
        except Exception as exc:  # routing still works, by load and round robin
            self.tokenizer_error = repr(exc)[:300]
            logger.warning("could not load tokenizer %s for cache-aware routing: %s", self.config.tokenizer,
                           self.tokenizer_error)

    # -- feeds ------------------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.cache_aware:
            return
        for url, endpoint in self.config.kv_events.items():
            self._tasks.append(asyncio.create_task(self._vllm_feed(url.rstrip("/"), endpoint),
                                                   name=f"kv-events {url}"))
        for url, address in self.controls.items():
            self.watch_history(url, address)

    def watch_history(self, p_url: str, address: str) -> None:
        """Follow a P sidecar's history (from serve's plan, or learned from P's first handoff)."""

        if not self.cache_aware or p_url not in self.prefill_urls:
            return
        task = self._history_tasks.get(p_url)
        if task is not None and not task.done() and self.controls.get(p_url) == address:
            return
        if task is not None:
            task.cancel()
        self.controls[p_url] = address
        self._history_tasks[p_url] = asyncio.get_running_loop().create_task(
            self._history_feed(p_url, address), name=f"history {p_url}")

    async def stop(self) -> None:
        tasks = self._tasks + list(self._history_tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._history_tasks = [], {}

    async def _ingest(self, url: str, payload, source: str, budget: "CpuBudget") -> None:
        """One batch from a feed: decoded and checked on a worker thread (a batch can hold a
        model's context of tokens to hash), applied here (dict updates), within the feed's CPU
        share. A feed past its share loses batches until it is back under it, and what the index
        held for the engine from that source is forgotten (it would be incomplete): routing by
        cache then treats the engine as holding nothing there, which costs a recompute at worst."""

        if not budget.available():
            self.index.refused[(source, Refusal.OVER_BUDGET)] += 1
            if not budget.dropping:
                budget.dropping = True
                self.index.forget(url, CACHE if source == "vllm" else HISTORY_GPU | HISTORY_CPU)
                logger.warning("KV events from %s (%s) exceed the router's CPU share for a feed (%.0f%% of a "
                               "core): dropping batches until it is back under it", url, source,
                               100 * budget.share)
            return
        budget.dropping = False
        checked, refusals, seconds = await asyncio.to_thread(_timed_check, self.index, url, payload, source)
        budget.spend(seconds)
        self.index.apply_checked(url, checked, refusals, source)

    def _feed_error(self, source: str, reason: str) -> None:
        key = (source, reason)
        self.feed_errors[key] = self.feed_errors.get(key, 0) + 1

    async def _vllm_feed(self, url: str, endpoint: str) -> None:
        """Subscribe to one engine's vLLM KV events. Frames: (topic, seq as 8 bytes, payload);
        anything else is refused before the payload is looked at."""

        import zmq
        import zmq.asyncio

        if self._zmq is None:
            self._zmq = zmq.asyncio.Context.instance()
        sock = self._zmq.socket(zmq.SUB)
        # libzmq drops a larger message before it is handed to us.
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES + 4096)
        # Few batches wait: a feed that falls behind loses batches (counted as gaps), it does not
        # queue gigabytes in libzmq.
        sock.setsockopt(zmq.RCVHWM, EVENT_QUEUE_BATCHES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        last_seq = None
        budget = CpuBudget(EVENT_CPU_SHARE, EVENT_CPU_BURST_S)
        try:
            sock.connect(endpoint)
            while True:
                frames = await sock.recv_multipart()
                try:
                    if len(frames) != 3 or len(frames[0]) > 256 or len(frames[1]) != 8:
                        self.index.refused[("vllm", Refusal.FRAMING)] += 1
                        continue
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    if last_seq is not None and seq <= last_seq:
                        # The engine restarted (its numbering starts over): what it held is gone.
                        self.index.forget(url, CACHE)
                        self._feed_error("vllm", "restarted")
                    elif last_seq is not None and seq > last_seq + 1:
                        # Missed batches (dropped at the queue bound): a removal among them would
                        # leave the index claiming blocks the engine evicted, and routing would
                        # send prompts to an engine that recomputes them. Start over from what
                        # comes next: holding too little costs a recompute at worst.
                        self.index.forget(url, CACHE)
                        self._feed_error("vllm", "gap")
                    last_seq = seq
                    await self._ingest(url, frames[2], "vllm", budget)
                except Exception:  # a bug here must not stop the feed
                    logger.exception("applying KV events from %s failed", url)
                    self._feed_error("vllm", "internal_error")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("KV events feed from %s (%s) stopped: %r", url, endpoint, exc)
            self._feed_error("vllm", "stopped")
        finally:
            sock.close(linger=0)

    async def _history_feed(self, url: str, address: str) -> None:
        from ..control import peer as pc

        since, instance, failures = -1, "", 0
        history_budget = CpuBudget(EVENT_CPU_SHARE, EVENT_CPU_BURST_S)
        while True:
            try:
                if self.call_sidecar is None:
                    raise ConnectionError("the router holds no router key")
                answer = await self.call_sidecar(address, pc.Residency(since, instance), timeout_s=5.0)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                self._feed_error("history", "unreachable")
                if failures == 1:
                    logger.warning("history residency of %s (%s) unreachable: %r", url, address, exc)
                await asyncio.sleep(min(5.0, RESIDENCY_POLL_S * 2 ** min(failures, 5)))
                continue
            if answer.reset or answer.instance != instance:
                self.index.forget(url, HISTORY_GPU | HISTORY_CPU)
            await self._ingest(url, answer.events, "history", history_budget)
            since, instance = answer.seq, answer.instance
            # An answer holds up to 65536 changes, so this keeps up with any history's churn.
            await asyncio.sleep(RESIDENCY_POLL_S)

    # -- choosing ---------------------------------------------------------------------------------

    async def prompt_tokens(self, endpoint: str, body: dict) -> list[int] | None:
        """The prompt's token ids as the engines will see them, or None (batch prompts, no
        tokenizer, a shape the router does not render)."""

        if endpoint == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
                return prompt
            if isinstance(prompt, str) and self.tokenizer is not None and len(prompt) <= MAX_TOKENIZE_CHARS:
                add_special = body.get("add_special_tokens", True) is not False
                return await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=add_special)
            return None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or self.tokenizer is None:
            return None
        try:
            return await asyncio.to_thread(self._chat_tokens, messages, body)
        except Exception:  # a template the router cannot render: the engines will tell the client
            return None

    def _chat_tokens(self, messages: list, body: dict) -> list[int] | None:
        if sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict)) > MAX_TOKENIZE_CHARS:
            return None
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            continue_final_message=bool(body.get("continue_final_message", False)))
        if not isinstance(text, str):
            return None
        return self.tokenizer.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))

    def round_robin(self) -> Pick:
        p = self.prefill_urls[self._rr_p % len(self.prefill_urls)]
        d = self.decode_urls[self._rr_d % len(self.decode_urls)]
        self._rr_p += 1
        self._rr_d += 1
        return Pick(p, d, "round_robin")

    async def pick(self, endpoint: str, body: dict) -> Pick:
        if not self.cache_aware or body.get("cache_salt"):
            # A salted prompt's blocks hash apart from everyone else's (vLLM adds the salt): the
            # index cannot place it, and must not (a tenant's routing would reveal another's).
            return self.round_robin()
        tokens = await self.prompt_tokens(endpoint, body)
        hashes = self.hasher.block_hashes(tokens) if tokens else []
        index = self.index
        d = choose(self.decode_urls, {u: index.prefix(u, hashes) for u in self.decode_urls}, self.in_flight,
                   len(hashes), self._rr_d, self.config.load_weight)
        self._rr_d += 1
        held = d.blocks * self.config.block_size
        if tokens and self.config.disaggregate_below <= 1.0 and held >= self.config.disaggregate_below * len(tokens):
            return Pick(None, d.url, "none", len(tokens), 0, d.blocks)
        p: Choice = choose(self.prefill_urls, {u: index.prefix(u, hashes) for u in self.prefill_urls},
                           self.in_flight, len(hashes), self._rr_p, self.config.load_weight)
        self._rr_p += 1
        return Pick(p.url, d.url, p.how, len(tokens or ()), p.blocks, d.blocks)

    @contextlib.contextmanager
    def busy(self, url: str):
        self.in_flight[url] = self.in_flight.get(url, 0) + 1
        try:
            yield
        finally:
            self.in_flight[url] -= 1

    def check_tokens(self, pick: Pick, reply_json) -> None:
        """Count a prompt the router tokenized differently from the engine (its hashes are then
        wrong and the cache is never found): a sign of a different tokenizer or chat template."""

        if not pick.tokens or not isinstance(reply_json, dict):
            return
        usage = reply_json.get("usage")
        counted = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if type(counted) is int and counted != pick.tokens:
            self.token_mismatches += 1
            if self.token_mismatches in (1, 100, 10000):
                logger.warning("the router counted %d prompt tokens, the engine %d (%d such prompts): is "
                               "--tokenizer the served tokenizer?", pick.tokens, counted, self.token_mismatches)


class RoutingCollector:
    """The index and its feeds in Prometheus form, read at scrape time."""

    def __init__(self, routing: CacheRouting) -> None:
        self.routing = routing

    def collect(self):
        index = self.routing.index
        events = CounterMetricFamily("kvbaton_router_kv_events", "KV events applied to the routing index",
                                     labels=["source", "kind"])
        for (source, kind), n in sorted(index.accepted.items()):
            events.add_metric([source, kind], n)
        refused = CounterMetricFamily("kvbaton_router_kv_events_refused",
                                      "KV event batches or events refused (dropped), by source and reason",
                                      labels=["source", "reason"])
        for (source, reason), n in sorted(index.refused.items()):
            refused.add_metric([source, reason], n)
        feeds = CounterMetricFamily("kvbaton_router_kv_feed_problems",
                                    "KV event feeds: restarts, gaps, unreachable sidecars", labels=["source", "kind"])
        for (source, kind), n in sorted(self.routing.feed_errors.items()):
            feeds.add_metric([source, kind], n)
        blocks = GaugeMetricFamily("kvbaton_router_index_blocks", "Blocks the routing index holds per engine",
                                   labels=["engine"])
        for engine in sorted(index.blocks):
            blocks.add_metric([engine], index.size(engine))
        agree = GaugeMetricFamily("kvbaton_router_hash_agreement",
                                  "1 when the engine's block hashes were recomputed by the router and agreed",
                                  labels=["engine"])
        for engine, ok in sorted(index.hash_agreement.items()):
            agree.add_metric([engine], 1.0 if ok else 0.0)
        mismatch = CounterMetricFamily("kvbaton_router_prompt_token_mismatches",
                                       "Prompts the router tokenized to a different length than the engine")
        mismatch.add_metric([], self.routing.token_mismatches)
        in_flight = GaugeMetricFamily("kvbaton_router_engine_in_flight",
                                      "Requests the router has in flight on each engine (a stream until it ends)",
                                      labels=["engine"])
        for engine, n in sorted(self.routing.in_flight.items()):
            in_flight.add_metric([engine], n)
        yield from (events, refused, feeds, blocks, agree, mismatch, in_flight)


# What one engine's event feed may cost the router: a share of one core, with a burst allowance.
EVENT_CPU_SHARE = 0.25
EVENT_CPU_BURST_S = 0.5
EVENT_QUEUE_BATCHES = 256


class CpuBudget:
    """A token bucket of CPU seconds, refilled at `share` seconds per second up to `burst_s`."""

    def __init__(self, share: float, burst_s: float) -> None:
        self.share, self.burst_s = share, burst_s
        self.tokens = burst_s
        self.at = time.monotonic()
        self.dropping = False

    def available(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst_s, self.tokens + (now - self.at) * self.share)
        self.at = now
        return self.tokens > 0

    def spend(self, seconds: float) -> None:
        self.tokens -= seconds


def _timed_check(index, url: str, payload, source: str):
    started = time.thread_time()
    checked, refusals = index.check(url, payload, source)
    return checked, refusals, time.thread_time() - started
