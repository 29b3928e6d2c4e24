"""EngineCore: one model, one cache pool, one scheduler; `step()` runs one continuous-batching forward.

Used by `LLM` (offline), by the prefill and decode workers and by the local dispatcher (all through
`EngineLoop` except `LLM`). Everything about a
request's progress is host state in `Request`; the step turns the scheduled chunks into one StepBatch,
runs the model, then samples every request whose chunk reached its last known token.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from dsv4_kernels.settings import settings
from engine.execution.cuda_graphs import DecodeRunner
from engine.execution.decode_overlap import LaunchedDecode, next_step_is_known, overlappable_decode_step
from engine.execution.prefill_graphs import PrefillRunner
from engine.execution.prefix_cache import DEFAULT_SNAPSHOT_INTERVAL, PrefixCache, PrefixCacheConfig
from engine.execution.request import Request, TokenEvent
from engine.execution.sampling import draw_requests, greedy_pick
from engine.execution.sampling_params import SamplingParams
from engine.execution.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from engine.execution.tp_executor import DECODE, FORWARD, SYNC, StepInputs, replicate_pages
from engine.handoff import DecodeOverloaded, EngineLoad
from engine.model.allocator import OutOfPages
from engine.model.batch import build_step, to_device_nonblocking
from engine.model.cache import CacheConfig, CachePool
from engine.model.config import ModelConfig
from engine.model.fast_paths import use_triton
from engine.model.model import DeepseekV4Model
from engine.model.parallel import SINGLE, ParallelContext

DECODE_MODES = ("auto", "eager", "bucketed", "graphs")
PREFILL_MODES = ("auto", "eager", "bucketed", "graphs")


class EngineCore:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict,
        device="cpu",
        dtype=torch.float32,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        decode_mode: str = "auto",
        prefix_cache: PrefixCacheConfig | bool = True,
        parallel: ParallelContext | None = None,
        overlap_decode: bool | None = None,
        speculative_tokens: int = 0,
        speculative_policy=None,
        prefill_mode: str = "auto",
        prefill_min_tokens: int | None = None,
    ):
        """decode_mode: how steps made only of decode tokens run (steps with prefill: prefill_mode):
        "graphs" replays CUDA graphs per (batch, context) bucket (engine.execution.cuda_graphs); "bucketed" runs the
        same fixed-shape batches without graphs (tests, debugging); "eager" sizes every step to its
        content; "auto" = "graphs" on CUDA in bf16/fp16 with the Triton fast path, else "eager".
        parallel: this rank's tensor-parallel context (weights cut by engine.model.sharding.shard_weights); rank 0
        schedules and broadcasts each step's inputs, the other ranks run engine.execution.tp_executor.follow.
        overlap_decode: launch a greedy decode step from the previous one's device tokens before reading them
        (engine.execution.decode_overlap); None = $DSV4_OVERLAP_DECODE (a boolean) if set, else on with "graphs" (where the
        host time would show), off otherwise.
        speculative_tokens / speculative_policy: MTP drafts (engine.execution.speculative) and when to make them
        (engine.execution.spec_policy.SpecPolicy, None: its defaults); decode-only steps then run as fixed-shape
        speculative steps in decode_mode's way (graphs / bucketed), overlap_decode deciding whether greedy ones are
        launched before the previous one is read (engine.execution.spec_overlap).
        prefill_mode: how steps with prefill tokens run: "graphs" pads them to a token-count bucket and replays its
        CUDA graph (engine.execution.prefill_graphs); "bucketed" runs the same padded batches without graphs (tests);
        "eager" sizes every step to its content; "auto" = "graphs" where $DSV4_PREFILL_GRAPHS is on and decode_mode
        resolved to "graphs", else "eager". Steps with prompt log-probs, and those no bucket holds, run eagerly; so
        do all steps of tensor-parallel, data-parallel and speculative engines.
        prefill_min_tokens: the smallest token bucket (None: $DSV4_PREFILL_GRAPH_MIN_TOKENS)."""
        self.cfg = cfg
        parallel = parallel or SINGLE
        # Data-parallel attention: this rank schedules its own requests as a lone engine would (self.parallel is
        # one rank's); only the model's MoE blocks see the group, and engine.execution.dp_attention keeps the ranks' steps
        # in lockstep. Its steps run without CUDA graphs or overlap: each rank's token count varies per step.
        self.data_parallel = parallel if parallel.data_parallel_attention else None
        self.parallel = parallel.attention
        self.device = torch.device(device)
        self.dtype = dtype
        self.scheduler_config = scheduler_config or SchedulerConfig()
        self.cache_config = cache_config or CacheConfig(max_requests=self.scheduler_config.max_num_seqs)
        self.model = DeepseekV4Model(cfg, weights, self.device, parallel)
        if speculative_tokens:  # MTP drafts (engine.execution.speculative), the MTP KV in the swa group
            if parallel.enabled:
                raise ValueError("speculative decoding does not run on tensor-parallel or data-parallel engines yet")
            spec_overlap, overlap_decode = overlap_decode, False  # the Speculator overlaps its own steps
            self.cache_config = dataclasses.replace(self.cache_config, mtp_layers=cfg.num_nextn_predict_layers)
        self.pool = CachePool(cfg, self.cache_config, dtype, self.device)
        if isinstance(prefix_cache, bool):
            # Snapshot points where a full chunk ends anyway: a point inside a chunk cuts it, and a prefill
            # step is host-bound below a few thousand tokens (BENCHMARKS.md bench_gpu, prefill profile).
            interval = max(DEFAULT_SNAPSHOT_INTERVAL, self.scheduler_config.max_batch_tokens)
            prefix_cache = PrefixCacheConfig(enabled=prefix_cache, snapshot_interval=interval)
        # Off: no cache object at all (nothing shared, no snapshot store, no chunk cuts).
        self.prefix = (
            PrefixCache(self.pool, prefix_cache, self.cache_config.max_requests) if prefix_cache.enabled else None
        )
        self.scheduler = Scheduler(self.pool, self.scheduler_config, self.prefix)
        self.decode_mode = self._resolve_decode_mode(decode_mode)
        self.decode_runner = None
        if self.decode_mode != "eager":
            self.decode_runner = DecodeRunner(
                self.model,
                self.pool,
                "graphs" if self.decode_mode == "graphs" else "eager",
                self.scheduler_config.max_num_seqs,
                cfg.max_position_embeddings,
            )
            if self.data_parallel is not None:  # the group agrees on each decode step's shape (its docstring)
                self.decode_runner.dp_ranks = self.data_parallel.tp_size
        env = settings().overlap_decode
        if overlap_decode is None:  # DSV4_OVERLAP_DECODE overrides the default (on with graphs)
            overlap_decode = self.decode_mode == "graphs" if env is None else env
        self.overlap_decode = (
            overlap_decode
            and self.decode_runner is not None
            and not self.parallel.enabled
            and self.data_parallel is None
        )
        self._launched: LaunchedDecode | None = (
            None  # a decode step not yet read back (engine.execution.decode_overlap)
        )
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # prefilled, caches kept until the decode side confirms
        self.imports: dict[str, Request] = {}  # decode side: pages reserved, caches arriving
        self.scheduler.arriving = self.imports  # each holds a batch slot the waiting queue must not take
        self._ids = itertools.count()
        self.prefill_runner = self._prefill_runner(prefill_mode, prefill_min_tokens, bool(speculative_tokens))
        self.speculator = None
        if speculative_tokens:
            from engine.execution.speculative import Speculator

            if spec_overlap is None:
                spec_overlap = self.decode_mode == "graphs" if env is None else env
            self.speculator = Speculator(self, weights, speculative_tokens, speculative_policy, overlap=spec_overlap)

    # ---- request lifecycle ---------------------------------------------------------------
    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """ValueError naming the offending value; called before anything is allocated."""
        if len(prompt) == 0:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.cfg.vocab_size
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is out of vocabulary (vocab_size {vocab})")
        total = len(prompt) + params.max_new_tokens
        if total > self.cfg.max_position_embeddings:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} = {total} "
                f"exceeds the model's maximum of {self.cfg.max_position_embeddings} positions"
            )
        if not self._fits_empty_pool(total):
            raise ValueError(
                f"request of {total} tokens can never fit the KV cache "
                f"({self.cache_config.max_tokens} tokens configured)"
            )

    def _resolve_decode_mode(self, mode: str) -> str:
        if mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {mode!r}")
        if mode == "auto":
            # fp8 caches too: their fast paths (engine.model.attention_fp8) never sync with the host
            # Data-parallel attention ranks: graphs only when asked for ('graphs'): their agreed-shape decode
            # steps (_step_lockstep) ran under graphs on no multi-GPU machine yet.
            graphs = (
                self.device.type == "cuda"
                and use_triton(self.device)
                and self.dtype != torch.float32
                and not self.parallel.host_collectives  # host-copied collectives cannot be captured
                and self.data_parallel is None
            )
            return "graphs" if graphs else "eager"
        if mode == "graphs" and self.device.type != "cuda":
            raise ValueError(f"decode_mode 'graphs' needs a CUDA device, got {self.device}")
        if mode == "graphs" and self.dtype == torch.float32:
            # fp32 expert GEMMs (grouped_mm's fallback) and quantised cache reads sync with the host.
            raise ValueError("decode_mode 'graphs' needs dtype bfloat16 or float16, got float32")
        return mode

    def _prefill_runner(self, mode: str, min_tokens: int | None, speculative: bool) -> PrefillRunner | None:
        if mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {mode!r}")
        if mode == "auto":
            mode = "graphs" if settings().prefill_graphs and self.decode_mode == "graphs" else "eager"
        if mode == "graphs" and (self.device.type != "cuda" or self.dtype == torch.float32):
            raise ValueError(f"prefill_mode 'graphs' needs a CUDA device in bf16/fp16, got {self.device} {self.dtype}")
        if mode == "eager" or speculative or self.parallel.enabled or self.data_parallel is not None:
            return None
        return PrefillRunner(
            self.model,
            self.pool,
            "graphs" if mode == "graphs" else "eager",
            self.scheduler_config.max_batch_tokens,
            self.scheduler_config.max_num_seqs,
            settings().prefill_graph_min_tokens if min_tokens is None else min_tokens,
        )

    def _fits_empty_pool(self, total: int) -> bool:
        return all(g.spec.pages_for_tokens(total) <= g.usable_pages for g in self.pool.groups.values())

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prefill_only: bool = False,
        seed: int | None = None,
    ) -> str:
        """Queue a request. `prefill_only`: stop after the first token and hold the caches (see `release`)."""
        prompt = list(prompt)
        self.validate(prompt, params)
        rid = self._new_id(request_id)
        req = Request(rid, prompt, params, seed=seed, prefill_only=prefill_only)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _new_id(self, request_id: str | None) -> str:
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests or rid in self.held or rid in self.imports:
            raise ValueError(f"duplicate request id {rid!r}")
        return rid

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is (queued, running, held or importing) and free its pages."""
        if self.speculator is not None:
            self.speculator.forget(request_id)  # its drafts (sampled: their q rows, device memory)
        for table in (self.requests, self.held, self.imports):
            req = table.pop(request_id, None)
            if req is None:
                continue
            req.finish_reason = req.finish_reason or "abort"
            if table is self.requests:
                self.scheduler.finish(req)
            else:
                self._drop(req)

    # ---- disaggregation hooks ------------------------------------------------------------
    def release(self, request_id: str) -> None:
        """Prefill side: the decode side confirmed the hand-off; free the held caches."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self._drop(req)

    def _drop(self, req: Request) -> None:
        """Free the pages of a request outside the scheduler (held or importing)."""
        self.pool.free(req.pages)
        if self.prefix is not None:
            self.prefix.forget(req)

    def held_request(self, request_id: str) -> Request:
        return self.held[request_id]

    def load(self) -> EngineLoad:
        """The one load figure of this engine (gauges, worker stats and router placement read it)."""
        running = len(self.scheduler.running) + len(self.held) + len(self.imports)
        in_batch = len(self.scheduler.running) + len(self.imports)  # imports join the batch when they land
        return EngineLoad(
            running=running,
            waiting=len(self.scheduler.waiting),
            kv_usage=max(self.pool.usage().values(), default=0.0),
            kv_free_tokens=self.pool.free_tokens(),
            free_slots=max(0, self.scheduler_config.max_num_seqs - in_batch),
        )

    def reserve_import(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        seed: int,
        first_token: int,
        first_logprob: float,
        prompt_logprobs: list | None = None,
    ) -> dict:
        """Decode side: reserve pages for a prefilled request; -> its page table (the transfer target)."""
        prompt = list(prompt)
        self.validate(prompt, params)
        rid = self._new_id(request_id)
        taken = len(self.scheduler.running) + len(self.imports)
        if taken >= self.scheduler_config.max_num_seqs:  # checked with the pages, before any byte moves
            raise DecodeOverloaded(
                f"no batch slot for {rid}: {taken} requests running or arriving "
                f"(max_num_seqs {self.scheduler_config.max_num_seqs})"
            )
        req = Request(
            rid, prompt, params, output=[first_token], logprobs=[first_logprob], seed=seed, num_computed=len(prompt)
        )
        if prompt_logprobs is not None:
            req.prompt_logprobs = list(prompt_logprobs)
        try:
            self.pool.grow(req.pages, req.max_total_tokens)  # raises OutOfPages, nothing taken
        except OutOfPages:
            if not self._settle_deferred_frees():
                raise
            self.pool.grow(req.pages, req.max_total_tokens)
        self.imports[rid] = req
        return req.pages

    def commit_import(self, request_id: str) -> None:
        """Decode side: the caches arrived; the request joins the running batch."""
        req = self.imports.pop(request_id)
        if self.parallel.enabled:  # the transfer wrote rank 0's pool; the other ranks get the same rows
            self.execute(StepInputs(SYNC, sync=(req.pages,)))
        self.requests[request_id] = req
        self.scheduler.admit_with_pages(req)

    def pop_finished(self, request_id: str) -> Request:
        return self.requests.pop(request_id)

    @property
    def has_work(self) -> bool:
        spec = self.speculator
        return self.scheduler.has_work or self._launched is not None or (spec is not None and spec.launched is not None)

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        if self.data_parallel is not None:
            return self._step_lockstep()
        if self._launched is not None:
            return self._complete_launched()
        if self.speculator is not None:
            return self.speculator.step()
        if self.decode_runner is not None:
            self.decode_runner.take_greedy()  # only this step's decode run may leave one
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        if self.overlap_decode and overlappable_decode_step(chunks):
            self._launched = self._launch_decode(chunks, None)
            if self._launched is not None:
                return self._complete_launched()
        if self.decode_runner is not None and all(
            c.num_tokens == 1 and c.start + 1 == c.request.num_tokens for c in chunks
        ):
            logits = self.execute(
                StepInputs(
                    DECODE,
                    tuple(c.request.token_slice(c.start, c.start + 1) for c in chunks),
                    tuple(c.start for c in chunks),
                    tuple(c.request.pages for c in chunks),
                    request_ids=tuple(c.request.request_id for c in chunks),
                    sync=self._restored(chunks),
                )
            )
            if logits is not None:  # every request samples; no prompt-logprob rows in a decode step
                return self._postprocess(chunks, logits, list(range(len(chunks))), [(0, 0)] * len(chunks))
        if self.prefill_runner is not None and any(
            c.start + c.num_tokens != c.request.num_tokens or c.num_tokens > 1 for c in chunks
        ):
            events = self._run_padded(chunks)
            if events is not None:
                return events
        inputs, sample_rows, prompt_rows = self._build(chunks)
        logits = self.execute(inputs)
        events = self._postprocess(chunks, logits, sample_rows, prompt_rows)
        return events

    def _run_padded(self, chunks: list[ScheduledChunk]) -> list[TokenEvent] | None:
        """A step with prefill through the PrefillRunner (its bucket's graph) -> its events; None when it must run
        eagerly (prompt log-probs: per-token logit rows; no bucket holds it): nothing ran then."""
        if any(c.request.params.prompt_logprobs and c.start < len(c.request.prompt) - 1 for c in chunks):
            return None
        runner = self.prefill_runner
        assert runner is not None  # called where the engine has one
        prefix = self.prefix
        logits = runner.run(
            [c.request.token_slice(c.start, c.start + c.num_tokens) for c in chunks],
            [c.start for c in chunks],
            [c.request.pages for c in chunks],
            [(c.snapshot_at, prefix.staging(c.request)) if c.snapshot_at and prefix else None for c in chunks],
        )
        if logits is None:
            return None
        # logits row i: chunk i's last token; sampled where the chunk reached the request's newest token
        sample_rows = [i if c.start + c.num_tokens == c.request.num_tokens else None for i, c in enumerate(chunks)]
        return self._postprocess(chunks, logits, sample_rows, [(0, 0)] * len(chunks))

    def _step_lockstep(self) -> list[TokenEvent]:
        """One tick of a data-parallel attention group (engine.execution.dp_attention): every rank runs this once a tick in
        which some rank has work, with or without requests of its own. The ranks first agree on the tick: a
        decode step of one shared bucket (the largest batch and context any rank needs) when every rank that runs
        anything runs only decode tokens and a bucket holds them; its MoE exchanges then move `slots` rows a rank
        with no host-side count gather (CUDA graphs can hold them), and a rank without requests replays the
        bucket on padding rows. Otherwise an eager step: each rank its own tokens, a rank with none joining the
        exchanges through idle_forward."""
        runner = self.decode_runner
        if runner is not None:
            runner.take_greedy()  # only this step's decode run may leave one
        chunks = self.scheduler.schedule() if self.scheduler.has_work else []
        decode = (
            bool(chunks)
            and runner is not None
            and all(c.num_tokens == 1 and c.start + 1 == c.request.num_tokens for c in chunks)
        )
        want = (len(chunks), max(c.start for c in chunks) + 1) if decode else (-1 if chunks else 0, 0)
        if self.data_parallel is None:
            raise RuntimeError("a lockstep tick needs the data-parallel group")
        wants = self.data_parallel.gather_values(want)
        shape = None
        if runner is not None and all(n >= 0 for n, _ in wants) and any(n > 0 for n, _ in wants):
            shape = runner.shape_for(max(n for n, _ in wants), max(c for _, c in wants))
        if runner is not None and shape is not None:
            if not chunks:
                runner.run_idle(shape)
                return []
            logits = runner.run(
                [c.request.request_id for c in chunks],
                [c.request.token_slice(c.start, c.start + 1)[0] for c in chunks],
                [c.start for c in chunks],
                [c.request.pages for c in chunks],
                shape=shape,
            )
            return self._postprocess(chunks, logits, list(range(len(chunks))), [(0, 0)] * len(chunks))
        if not chunks:
            if any(n for n, _ in wants):  # another rank runs a forward: serve its tokens' experts
                self.model.idle_forward()
            return []
        inputs, sample_rows, prompt_rows = self._build(chunks)
        return self._postprocess(chunks, self.execute(inputs), sample_rows, prompt_rows)

    # ---- overlapped decode (engine.execution.decode_overlap) ---------------------------------------------
    def _launch_decode(self, chunks, previous: LaunchedDecode | None) -> LaunchedDecode | None:
        """Queue one decode step and its picks -> its LaunchedDecode, or None when no decode bucket fits (nothing
        ran).

        previous: the step before it, still unread on the host; its picked tokens are this step's inputs (and its
        requests' outputs are one token shorter than at this step's draw: the sampled rows' draw index adds 1)."""
        tokens = (
            [0] * len(chunks)
            if previous is not None
            else [c.request.token_slice(c.start, c.start + 1)[0] for c in chunks]
        )
        runner = self.decode_runner
        assert runner is not None  # overlapped decode runs on bucketed / graph decode steps only
        logits = runner.run(
            [c.request.request_id for c in chunks],
            tokens,
            [c.start for c in chunks],
            [c.request.pages for c in chunks],
            token_source=previous.picked[0] if previous is not None else None,
        )
        if logits is None:
            return None
        self.pool.defer_frees()  # until this step completes: it writes these requests' rows
        picked = runner.take_greedy()
        if any(c.request.params.temperature != 0 for c in chunks):
            picked = draw_requests(logits, [c.request for c in chunks], ahead=int(previous is not None))
        return LaunchedDecode.of(chunks, picked if picked is not None else greedy_pick(logits))

    def _complete_launched(self) -> list[TokenEvent]:
        """Launch the step after the unread one when it is certain (engine.execution.decode_overlap), then read the unread
        one back and report it. Rows of requests that finished or were aborted since their launch are dropped."""
        step, self._launched = self._launched, None
        assert step is not None  # called while a launched step is unread
        sched = self.scheduler
        if next_step_is_known(step, sched.running, sched.waiting, self.prefix.block if self.prefix else None):
            self._launched = self._launch_decode(step.next_chunks(), step)
        tokens, lps = step.read()
        keep = [i for i, c in enumerate(step.chunks) if not c.request.finished]
        chunks = [step.chunks[i] for i in keep]
        events = self._postprocess(
            chunks,
            None,
            list(range(len(chunks))),
            [(0, 0)] * len(chunks),
            sampled=([tokens[i] for i in keep], [lps[i] for i in keep]),
        )
        if self._launched is None:
            self.pool.release_deferred_frees()  # nothing queued writes rows any more
        return events

    def _settle_deferred_frees(self) -> bool:
        """Wait for the launched step's device work, then return the pages freed while it was in flight (an import
        must not fail for pages that an aborted request gives back one step later). -> whether any came back."""
        launched = self._launched or (self.speculator.launched if self.speculator is not None else None)
        if launched is None or not self.pool.has_deferred_frees:
            return False
        launched.wait()  # the newest launch: every earlier one has completed too
        self.pool.release_deferred_frees()  # the next launch defers again
        return True

    def _build(self, chunks: list[ScheduledChunk]):
        """-> (StepInputs, per chunk: index into logit rows to sample or None, per chunk: prompt-logprob rows)."""
        logit_rows: list[int] = []
        sample_rows: list[int | None] = []
        prompt_rows: list[tuple[int, int]] = []
        offset = 0
        for c in chunks:
            req, end = c.request, c.start + c.num_tokens
            rows = []
            if req.params.prompt_logprobs and c.start < len(req.prompt) - 1:
                last = min(end, len(req.prompt) - 1)  # row p scores prompt token p + 1
                rows = list(range(offset, offset + last - c.start))
            prompt_rows.append((len(logit_rows), len(rows)))
            logit_rows.extend(rows)
            if end == req.num_tokens:  # reached the newest token: sample the next one
                if rows and rows[-1] == offset + c.num_tokens - 1:
                    sample_rows.append(len(logit_rows) - 1)
                else:
                    sample_rows.append(len(logit_rows))
                    logit_rows.append(offset + c.num_tokens - 1)
            else:
                sample_rows.append(None)
            offset += c.num_tokens
        snapshots = (
            tuple((c.snapshot_at, self.prefix.staging(c.request)) if c.snapshot_at else None for c in chunks)
            if any(c.snapshot_at for c in chunks) and self.prefix is not None  # snapshots come from the prefix cache
            else ()
        )
        inputs = StepInputs(
            FORWARD,
            tuple(c.request.token_slice(c.start, c.start + c.num_tokens) for c in chunks),
            tuple(c.start for c in chunks),
            tuple(c.request.pages for c in chunks),
            tuple(logit_rows),
            sync=self._restored(chunks),
            snapshots=snapshots,
        )
        return inputs, sample_rows, prompt_rows

    def _restored(self, chunks: list[ScheduledChunk]) -> tuple:
        """Tensor parallel: the fixed pages a prefix-cache hit just restored on rank 0 only (a request's first
        chunk after a hit starts at its cached tokens); the other ranks must get them before the step."""
        if not (self.parallel.enabled and self.prefix is not None):
            return ()
        groups = self.prefix.store.groups
        return tuple(
            {g: c.request.pages[g] for g in groups if g in c.request.pages}
            for c in chunks
            if c.request.cached_tokens and c.start == c.request.cached_tokens
        )

    def execute(self, inputs: StepInputs) -> torch.Tensor | None:
        """Run one step's model inputs on this rank -> fp32 logits, or None when a decode step fits no bucket.

        Rank 0 of a tensor-parallel group first broadcasts `inputs` (engine.execution.tp_executor); followers call this
        with what they received, so every rank runs the same forward and its collectives."""
        if self.parallel.enabled and self.parallel.is_driver:
            self.parallel.broadcast_object(inputs)
        replicate_pages(self.pool, inputs.sync, self.parallel)
        if inputs.kind == SYNC:
            return None
        if inputs.kind == DECODE:
            assert self.decode_runner is not None  # DECODE inputs exist only on engines with decode buckets
            return self.decode_runner.run(
                list(inputs.request_ids), [t[0] for t in inputs.token_ids], list(inputs.starts), list(inputs.tables)
            )
        batch = build_step(
            self.pool,
            [list(t) for t in inputs.token_ids],
            list(inputs.starts),
            list(inputs.tables),
            list(inputs.logit_rows),
            self.device,
            list(inputs.snapshots),
        )
        return self.model.forward(batch, self.pool)

    def _sample(self, logits: torch.Tensor, todo: list) -> tuple[list[int], list[float]]:
        """Sample the rows of `todo` [(chunk, logit row)] -> (tokens, their log-probs), read back in one copy.

        A decode step samples every row in order (no index copy); an all-greedy batch is an argmax, decided on
        the host from the requests' parameters (no parameter uploads, no device-to-host check)."""
        rows = [r for _, r in todo]
        dev = logits.device
        sel = (
            logits
            if rows == list(range(logits.shape[0]))
            else logits[to_device_nonblocking(torch.tensor(rows, dtype=torch.long), dev)]
        )
        params = [c.request.params for c, _ in todo]
        if all(p.temperature == 0 for p in params):
            # The decode graph computed this already (engine.execution.cuda_graphs); else the same function here.
            ready = self.decode_runner.take_greedy() if self.decode_runner is not None else None
            both = (ready if ready is not None and sel is logits else greedy_pick(sel)).tolist()
            return [int(t) for t in both[0]], both[1]
        both = draw_requests(sel, [c.request for c, _ in todo]).tolist()
        return [int(t) for t in both[0]], both[1]

    def _postprocess(self, chunks, logits, sample_rows, prompt_rows, sampled: tuple | None = None) -> list[TokenEvent]:
        """sampled: (token ids, log-probs) of the sampled rows when they were picked already (a launched step)."""
        todo = [(c, r) for c, r in zip(chunks, sample_rows) if r is not None]
        if sampled is not None:
            tokens, token_lps = sampled
        else:
            tokens, token_lps = self._sample(logits, todo) if todo else ([], [])
        # Prompt log-probs (prefill steps that ask for them) read whole rows of the log-softmax.
        logprobs = torch.log_softmax(logits, dim=-1) if any(count for _, count in prompt_rows) else None
        picked = {id(c): (tok, lp) for (c, _), tok, lp in zip(todo, tokens, token_lps)}

        events = []
        for c, (first, count) in zip(chunks, prompt_rows):
            req = c.request
            plps = ()
            if count and logprobs is not None:  # (computed whenever any chunk has a count)
                targets = torch.tensor(req.prompt[c.start + 1 : c.start + 1 + count], device=logits.device)
                plps = tuple(logprobs[first : first + count].gather(1, targets.unsqueeze(1)).squeeze(1).tolist())
                req.prompt_logprobs.extend(plps)
            req.num_computed = c.start + c.num_tokens
            if self.prefix is not None:
                self.prefix.on_computed(req)  # before a finished request's pages are freed below
            tok, lp = picked.get(id(c), (None, None))
            if tok is not None:
                req.output.append(tok)
                req.logprobs.append(lp)
                req.note_token(tok, self.cfg.eos_token_ids)
                if req.prefill_only and not req.finished:
                    self.scheduler.hold(req)  # caches stay until `release`
                    self.held[req.request_id] = self.requests.pop(req.request_id)
            if req.finished:
                self.scheduler.finish(req)
            events.append(TokenEvent(req.request_id, tok, lp, req.finished, req.finish_reason, plps, req.cached_tokens))
        return events
