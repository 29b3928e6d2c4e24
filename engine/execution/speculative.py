"""MTP speculative decoding inside EngineCore (`speculative_tokens` K > 0; docs: shared/docs/mtp.md sections 2-3).

One step (eager; `EngineCore.step` hands it here):
1. The scheduler's chunks as usual; a decode chunk of a request holding drafts becomes a verify chunk
   [last token + its drafts] (a short prefill chunk over cached history: the varlen path runs it, mixed
   with prefill chunks and with requests that have fewer or no drafts). Pages need no growth: admission
   reserved max_total_tokens and drafts are capped to the tokens the request may still emit.
2. The ring rows the verify positions will write are saved (engine.execution.spec_rollback), the target
   runs once (its residual streams kept), greedy acceptance takes the longest prefix of drafts equal to the
   target's argmax plus the target's next (bonus) token; the rejected positions' ring rows are restored.
3. The MTP layer runs over every position the target just computed and kept (token t+1 with the target's
   streams at t): that fills its own SWA KV over prompts and accepted tokens; its output at the newest
   position drafts token 1, then K-1 chained MTP steps (its own streams, the previous draft) draft the rest,
   their MTP ring rows saved and restored around the chain so the MTP KV only ever holds the accepted path.
Greedy output is token for token the non-speculative output (tests/engine/test_speculative.py). Sampled
requests (temperature > 0) draft from the MTP layer's distribution q under their own filters and verify by
rejection sampling (engine.execution.spec_sampling): their output has the non-speculative distribution.
A prefill-only request (the hand-off) gets the MTP pass over its prompt but no drafts: the MTP KV travels with
the swa group's ring page, and the decode side drafts after its first (one-token) step, whose streams it has.
Steps made only of decode / verify chunks run on fixed shapes with one host wait (engine.execution.spec_fixed: the
verify step, acceptance and rollback on the device, the MTP pass on the verify step's bucket and streams, the chain
one row a request; CUDA graphs in decode_mode graphs, eager bucketed in "bucketed"): the host waits for the
acceptance only and builds the next step while the device drafts, and the drafts stay on the device for the next
fixed step (DeviceDrafts). Steps with prefill chunks, the varlen engine (decode_mode "eager") and shapes no bucket
holds run the varlen step above, with the host deciding acceptance. Both paths emit the same tokens and draft the
same drafts (tests/engine/test_spec_mtp_graphs.py). engine.execution.spec_policy decides per step whether to draft
(at most speculative_max_batch decoding requests; an optional acceptance floor; measured pay: drafting steps faster
than plain ones at the batch size): the MTP pass runs either way, so its KV stays complete.
Decode-only steps are also launched before the previous one is read (engine.execution.spec_overlap, on with
overlap_decode: CUDA graphs by default), where the next step is certain up to finishes.
Not here yet: the fixed step as one CUDA graph (it is several replays and device ops with no host wait between them),
tensor/data parallel engines.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.execution import spec_rollback, spec_sampling
from engine.execution.mtp_graphs import MtpRunner
from engine.execution.request import Request, TokenEvent
from engine.execution.sampling import greedy_pick
from engine.execution.scheduler import ScheduledChunk
from engine.execution.spec_fixed import DeviceDrafts, FixedOutcome, FixedSpecStep, LaunchedSpec
from engine.execution.spec_overlap import next_spec_is_known
from engine.execution.spec_policy import SpecGate, SpecPolicy
from engine.execution.verify_graphs import VerifyRunner
from engine.model.batch import build_step
from engine.model.mtp import MtpLayer

MAX_SPECULATIVE_TOKENS = 3


@dataclass
class _Plan:
    """One scheduled chunk of this step: its tokens, first logit row and how many of those rows are drafts."""

    chunk: ScheduledChunk
    tokens: list[int]
    drafts: list[int]
    first_row: int  # this chunk's first row in the step's token rows
    emitted: list[tuple[int, float]] = field(default_factory=list)  # [(token, logprob)] this step appends (_pick)
    q: list[torch.Tensor] | None = None  # a sampled request's drafts' q rows (fp32 [V] each), else None
    computed: int = 0  # the request's num_computed after the step
    device: DeviceDrafts | None = None  # drafts still on the device (then `drafts` and `tokens` hold placeholders)


def _decode_chunk(c) -> bool:
    """A chunk of one token at the request's newest position (a decode step's, or a verify chunk's first), with no
    in-step prefix-cache snapshot and not a prefill-only hand-off."""
    req = c.request
    return c.num_tokens == 1 and c.start + 1 == req.num_tokens and not c.snapshot_at and not req.prefill_only


class Speculator:
    def __init__(self, core, weights: dict, k: int, policy: SpecPolicy | None = None, overlap: bool = False):
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens must be 0 (off) or 1..{MAX_SPECULATIVE_TOKENS}, got {k}")
        cfg = core.cfg
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError("speculative decoding needs the checkpoint's MTP layer (num_nextn_predict_layers >= 1)")
        if cfg.sliding_window < k + 1:
            raise ValueError(f"speculative_tokens {k} needs sliding_window >= {k + 1}, got {cfg.sliding_window}")
        self.core, self.k = core, k
        self.layers = [MtpLayer(core.model, weights, i) for i in range(cfg.num_nextn_predict_layers)]
        # request id -> drafts to verify in its next step (a fixed step leaves them on the device: DeviceDrafts)
        self.drafts: dict[str, list[int] | DeviceDrafts] = {}
        self.draft_q: dict[str, list[torch.Tensor]] = {}  # sampled requests: each draft's q [V] (spec_sampling)
        self.stats = {
            "drafted": 0,
            "accepted": 0,
            "verify_chunks": 0,
            "emitted": 0,
            "undrafted_steps": 0,
            "overlapped_steps": 0,  # launched before the previous step was read (engine.execution.spec_overlap)
        }
        self.gate = SpecGate(policy or SpecPolicy())  # when to draft (engine.execution.spec_policy)
        # decode-only steps as fixed-shape verify steps (graphs on CUDA, eager bucketed on the CPU) when the engine
        # buckets its decode steps; else (decode_mode "eager") every step takes the varlen path
        self.verify = VerifyRunner(core.decode_runner, k + 1) if core.decode_runner is not None else None
        # the MTP pass and chain on fixed shapes too (engine.execution.mtp_graphs); the whole decode-only step with
        # one host read (engine.execution.spec_fixed). mtp None: every step takes the varlen path (tests compare)
        self.mtp = MtpRunner(self.verify, self.layers) if self.verify is not None else None
        self.fixed = FixedSpecStep(self)
        # greedy decode-only steps launched before the previous one is read (engine.execution.spec_overlap)
        self.overlap = overlap and self.verify is not None
        self.launched: LaunchedSpec | None = None  # a fixed step not yet read by the host
        self._launched_drafting = False  # whether it drafts
        self._fixed_outcome: FixedOutcome | None = None  # this step's, when it ran on fixed shapes
        self._drafting: bool | None = None  # this step's drafting decision, when taken before the varlen path
        # Benchmarks only (force_acceptance): (drafts, the target's greedy picks) -> the drafts greedy acceptance
        # compares on the varlen path, applied after the verify forward (its cost is unchanged).
        self.force_drafts: Callable[[list[int], list[int]], list[int]] | None = None
        # the last pure decode step (requests, verified drafts, tokens emitted, start time) until the next starts
        self._last_step: tuple[int, bool, int, float] | None = None
        self._step_start = 0.0

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        core = self.core
        self._time_last_step(time.perf_counter())
        if self.launched is not None:
            return self._complete_launched()
        chunks = core.scheduler.schedule()
        if not chunks:
            return []
        pure_decode = all(_decode_chunk(c) for c in chunks)  # (before the step appends tokens)
        plans, row = [], 0
        for c in chunks:
            req = c.request
            drafts: list[int] | DeviceDrafts = []
            q = None
            if c.num_tokens == 1 and c.start + 1 == req.num_tokens:
                drafts = self.drafts.pop(req.request_id, [])[: self._room(req)]
                q = self.draft_q.pop(req.request_id, None)
            device = drafts if isinstance(drafts, DeviceDrafts) and pure_decode else None
            if isinstance(drafts, DeviceDrafts):  # fixed steps read them on the device; the varlen one needs them here
                drafts = [0] * len(drafts) if device is not None else drafts.values()
            plans.append(
                _Plan(
                    c,
                    req.token_slice(c.start, c.start + c.num_tokens) + drafts,
                    drafts,
                    row,
                    q=q[: len(drafts)] if q is not None and drafts else None,
                    device=device,
                )
            )
            row += len(plans[-1].tokens)
        drafted = [p for p in plans if p.drafts]
        before = (self.stats["drafted"], self.stats["accepted"])
        self._drafting = None
        if not (pure_decode and self._step_fixed(plans)):
            saved = spec_rollback.save_requests(  # one gather a ring group for every verify chunk
                core.pool,
                [p.chunk.request.pages for p in drafted],
                [torch.arange(p.chunk.start, p.chunk.start + len(p.tokens)) for p in drafted],
            )
            streams, logits, sample_rows, prompt_rows = self._forward(plans)
            self._pick(plans, logits, sample_rows)
            # positions start .. start + len(emitted) - 1 were computed on the accepted path: the rest go back
            spec_rollback.restore_tails(core.pool, saved, [len(p.emitted) for p in drafted])
            events = self._apply(plans, logits, prompt_rows)
            self._draft(plans, streams)
        else:
            events = self._apply(plans, None, [(0, 0)] * len(plans))
            self._keep_fixed_drafts(plans)
        self._end_step(plans, before, pure_decode, bool(drafted))
        return events

    def _end_step(self, plans: list[_Plan], before: tuple[int, int], pure_decode: bool, drafted: bool) -> None:
        """After the tokens are applied: the gate's observations, the prefix cache, held and finished requests."""
        core = self.core
        self.gate.observe(self.stats["drafted"] - before[0], self.stats["accepted"] - before[1])
        if pure_decode:  # timed to the next step's start (SpecGate.observe_rate)
            self._last_step = (len(plans), drafted, sum(len(p.emitted) for p in plans), self._step_start)
        for p in plans:
            req = p.chunk.request
            if core.prefix is not None:
                core.prefix.on_computed(req)  # after the MTP pass: a snapshot holds its ring rows too
            if req.prefill_only and not req.finished:
                core.scheduler.hold(req)  # caches stay until `release`
                core.held[req.request_id] = core.requests.pop(req.request_id)
            if req.finished:
                core.scheduler.finish(req)
                self.drafts.pop(req.request_id, None)
                self.draft_q.pop(req.request_id, None)

    def _time_last_step(self, now: float) -> None:
        """The previous step, if it was a pure decode step, took until `now`: its rate goes to the gate."""
        if self._last_step is not None:
            decoding, drafted, emitted, start = self._last_step
            self.gate.observe_rate(decoding, drafted, emitted, now - start)
        self._last_step, self._step_start = None, now

    def force_acceptance(self, rate: float | None, seed: int = 0) -> None:
        """Benchmarks only (benchmarks/spec.py): after the verify forward each draft counts as the target's pick with
        probability `rate`, else as another token (the step's cost stays the real one); None: off."""
        self.fixed.force_acceptance(rate, seed)
        if rate is None:
            self.force_drafts = None
            return
        g = random.Random(seed)
        self.force_drafts = lambda drafts, picks: [t if g.random() < rate else t + 1 for t in picks[: len(drafts)]]

    def _step_fixed(self, plans: list[_Plan]) -> bool:
        """A decode-only step on fixed shapes with one host wait (engine.execution.spec_fixed), the next one launched
        behind it when certain (engine.execution.spec_overlap) -> whether it ran (False: no bucket holds it, or the
        engine has none; nothing ran). Sets each plan's emitted tokens and row, and self._fixed_outcome for the
        drafts."""
        self._fixed_outcome = self._drafting = None
        if self.verify is None or self.mtp is None or self.fixed.shapes(plans, False) is None:
            _to_host(plans)
            return False
        drafting = self.gate.should_draft(len(plans))
        shapes = self.fixed.shapes(plans, drafting)
        if shapes is None:  # no chain bucket: the varlen path drafts, on this decision (the gate counts calls)
            self._drafting = drafting
            _to_host(plans)
            return False
        launched = self.fixed.launch(plans, shapes, drafting)
        self._launch_next(launched)
        self._take(launched, drafting, list(range(len(plans))))
        return True

    def _take(self, launched: LaunchedSpec, drafting: bool, keep: list[int]) -> None:
        """Read a launched fixed step: its plans `keep` (the others' requests finished or left meanwhile) get their
        emitted tokens; self._fixed_outcome holds its drafts."""
        out = launched.read()
        for b in keep:
            p = launched.plans[b]
            p.first_row, p.emitted = b * launched.queries, out.emitted[b]
            if p.drafts:
                self._count(p.chunk.request, len(p.drafts), out.accepted[b])
        if not drafting:
            self.stats["undrafted_steps"] += 1  # the MTP pass ran: its KV stays complete, drafting resumes exactly
        self._fixed_outcome = out

    # ---- overlapped steps (engine.execution.spec_overlap) ----------------------------------------------
    def _launch_next(self, step: LaunchedSpec) -> None:
        """Launch the step after `step` (unread) from its device outputs, when it is certain (spec_overlap)."""
        core = self.core
        if not self.overlap or self.launched is not None:
            return
        sched, block = core.scheduler, core.prefix.block if core.prefix is not None else None
        if not next_spec_is_known(step, sched.running, sched.waiting, self.k, block):
            return
        q = self.k + 1 if step.drafts is not None else 1
        plans = [
            _Plan(
                ScheduledChunk(p.chunk.request, p.chunk.start, 1),  # rebased when read (_complete_launched)
                [0] * q,
                [0] * (q - 1),
                b * q,
                q=step.qrows[b] if q > 1 else None,  # a sampled request's drafts' q rows (device)
                device=DeviceDrafts(step.drafts, b, q - 1) if step.drafts is not None else None,
            )
            for b, p in enumerate(step.plans)
        ]
        drafting = self.gate.should_draft(len(plans))
        shapes = self.fixed.shapes(plans, drafting, ahead=step.queries)
        if shapes is None:
            return
        core.pool.defer_frees()  # until no launched step can write the rows of a request freed meanwhile
        self.launched = self.fixed.launch(plans, shapes, drafting, source=step)
        self._launched_drafting = drafting
        self.stats["overlapped_steps"] += 1

    def _complete_launched(self) -> list[TokenEvent]:
        """Launch the step after the unread one when it is certain, then read the unread one and report it. Its
        requests that finished or were aborted since its launch are dropped."""
        step, self.launched = self.launched, None
        assert step is not None
        drafting = self._launched_drafting
        for p in step.plans:  # the previous step is applied: each request starts at its computed count now
            p.chunk = ScheduledChunk(p.chunk.request, p.chunk.request.num_computed, 1)
        self._launch_next(step)
        keep = [b for b, p in enumerate(step.plans) if _still_running(self.core, p.chunk.request)]
        before = (self.stats["drafted"], self.stats["accepted"])
        self._take(step, drafting, keep)
        plans = [step.plans[b] for b in keep]
        events = self._apply(plans, None, [(0, 0)] * len(plans))
        self._keep_fixed_drafts(plans, keep)
        self._end_step(plans, before, True, any(p.drafts for p in plans))
        if self.launched is None:
            self.core.pool.release_deferred_frees()  # nothing queued writes rows any more
        return events

    def _keep_fixed_drafts(self, plans: list[_Plan], columns: list[int] | None = None) -> None:
        """After `_apply`: the fixed step's drafts of the requests that go on (plan i's are column columns[i] of
        the step's drafts; default i)."""
        out = self._fixed_outcome
        if out is None or out.drafts is None:
            return
        picks, cols = out.drafts, columns if columns is not None else list(range(len(plans)))
        going = [i for i, p in enumerate(plans) if not p.chunk.request.finished]
        if going:
            drafts = [DeviceDrafts(picks, cols[i], picks.shape[0]) for i in going]  # read there by the next fixed step
            self._keep_drafts([plans[i] for i in going], drafts, [out.q[cols[i]] for i in going])

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a request's next step (it was aborted)."""
        self.drafts.pop(request_id, None)
        self.draft_q.pop(request_id, None)

    def draft_tokens(self, request_id: str) -> list[int]:
        """The drafts `request_id` holds for its next step, as token ids (a device read if they are still there)."""
        d = self.drafts.get(request_id, [])
        return d.values() if isinstance(d, DeviceDrafts) else list(d)

    def _room(self, req: Request) -> int:
        """Drafts worth verifying for `req`: K, fewer near max_new_tokens, none for a prefill-only request."""
        if req.prefill_only:
            return 0
        return max(0, min(self.k, req.params.max_new_tokens - len(req.output) - 1))

    def _forward(self, plans: list[_Plan]):
        """The target over every chunk -> (streams [T, hc, D], logits of the logit rows, per plan: logit row of its
        sample (None) or first verify row, per plan: (first, count) prompt-logprob logit rows)."""
        core = self.core
        logit_rows: list[int] = []
        sample_rows: list[int | None] = []  # per plan: its sample's (or first verify row's) logit row, else None
        prompt_rows: list[tuple[int, int]] = []
        for p in plans:
            c, req = p.chunk, p.chunk.request
            end, rows = c.start + c.num_tokens, []
            if req.params.prompt_logprobs and c.start < len(req.prompt) - 1:
                last = min(end, len(req.prompt) - 1)  # row p scores prompt token p + 1
                rows = list(range(p.first_row, p.first_row + last - c.start))
            prompt_rows.append((len(logit_rows), len(rows)))
            logit_rows.extend(rows)
            if end == req.num_tokens:  # reached the newest token: sample (or verify) from here
                if rows and rows[-1] == p.first_row + c.num_tokens - 1:
                    sample_rows.append(len(logit_rows) - 1)
                else:
                    sample_rows.append(len(logit_rows))
                    logit_rows.append(p.first_row + c.num_tokens - 1)
                logit_rows.extend(range(p.first_row + c.num_tokens, p.first_row + len(p.tokens)))  # the drafts'
            else:
                sample_rows.append(None)
        snapshots = (
            [
                (p.chunk.snapshot_at, core.prefix.staging(p.chunk.request)) if p.chunk.snapshot_at else None
                for p in plans
            ]
            if any(p.chunk.snapshot_at for p in plans)
            else None
        )
        batch = build_step(
            core.pool,
            [p.tokens for p in plans],
            [p.chunk.start for p in plans],
            [p.chunk.request.pages for p in plans],
            logit_rows,
            core.device,
            snapshots,
        )
        streams = core.model.forward_streams(batch, core.pool)
        return streams, core.model.logits(streams, batch.logit_rows), sample_rows, prompt_rows

    def _pick(self, plans: list[_Plan], logits: torch.Tensor, sample_rows: list) -> None:
        """Each plan's emitted tokens: one sample (core._sample) or, for a verify chunk, the accepted drafts plus the
        target's token after them (greedy: the longest prefix of drafts equal to the target's argmax)."""
        core = self.core
        todo = [(p.chunk, r) for p, r in zip(plans, sample_rows) if r is not None and not p.drafts]
        tokens, lps = core._sample(logits, todo) if todo else ([], [])
        plain = iter(zip(tokens, lps))
        greedy = [(p, r) for p, r in zip(plans, sample_rows) if p.drafts and p.q is None]
        picks: list = [[], []]  # [token ids, log-probs] of the greedy verify rows, in plan order
        if greedy:
            rows = torch.cat([torch.arange(r, r + len(p.drafts) + 1) for p, r in greedy]).to(logits.device)
            picks = greedy_pick(logits[rows]).tolist()
        sampled = self._verify_sampled(plans, logits, sample_rows)
        at = at_sampled = 0
        for p, r in zip(plans, sample_rows):
            if r is None:
                p.emitted = []
            elif not p.drafts:
                p.emitted = [next(plain)]
            elif p.q is None:  # greedy: the longest prefix of drafts equal to the target's argmax, then its token
                n = len(p.drafts) + 1
                toks, lp = [int(t) for t in picks[0][at : at + n]], picks[1][at : at + n]
                at += n
                if self.force_drafts is not None:
                    p.drafts = self.force_drafts(p.drafts, toks)
                a = 0
                while a < len(p.drafts) and p.drafts[a] == toks[a]:
                    a += 1
                p.emitted = list(zip(toks[: a + 1], lp[: a + 1]))
                self._count(p.chunk.request, len(p.drafts), a)
            else:  # rejection sampling: the accepted drafts, then the first row not accepted emits its draw
                assert sampled is not None  # _verify_sampled covered every plan with drafts and q rows
                a = spec_sampling.accepted_prefix(sampled[0], at_sampled, len(p.drafts))
                kept = range(at_sampled, at_sampled + a + 1)
                p.emitted = [(int(sampled[1][i]), sampled[2][i]) for i in kept]
                at_sampled += len(p.drafts) + 1
                self._count(p.chunk.request, len(p.drafts), a)

    def _verify_sampled(self, plans: list[_Plan], logits: torch.Tensor, sample_rows: list) -> list | None:
        """The sampled verify chunks' rows [drafts.., bonus] through spec_sampling.verify_sampled, in plan order ->
        its [3, R] result on the host (one copy), or None when there is none."""
        verify = [(p, r) for p, r in zip(plans, sample_rows) if p.drafts and p.q is not None]
        if not verify:
            return None
        dev = logits.device
        rows = torch.cat([torch.arange(r, r + len(p.drafts) + 1) for p, r in verify]).to(dev)
        drafts = torch.tensor([t for p, _ in verify for t in p.drafts + [-1]], dtype=torch.int64).to(dev)
        zero = logits.new_zeros(1, logits.shape[-1])
        q = torch.cat([torch.cat([torch.stack(p.q or []), zero]) for p, _ in verify])  # q given: filtered above
        reqs = [p.chunk.request for p, _ in verify for _ in range(len(p.drafts) + 1)]
        index = [len(p.chunk.request.output) + j for p, _ in verify for j in range(len(p.drafts) + 1)]
        return spec_sampling.verify_sampled(logits[rows], drafts, q, reqs, index).tolist()

    def _count(self, req: Request, drafted: int, accepted: int) -> None:
        req.drafted_tokens += drafted
        req.accepted_tokens += accepted
        self.stats["drafted"] += drafted
        self.stats["accepted"] += accepted
        self.stats["verify_chunks"] += 1
        self.stats["emitted"] += accepted + 1

    def _apply(self, plans: list[_Plan], logits: torch.Tensor | None, prompt_rows: list) -> list[TokenEvent]:
        """Append each plan's tokens (stopping at a finish), advance num_computed -> the step's events (logits: of
        the prompt-logprob rows; None when there are none)."""
        core = self.core
        logprobs = torch.log_softmax(logits, dim=-1) if logits is not None and any(n for _, n in prompt_rows) else None
        events = []
        for p, (first, count) in zip(plans, prompt_rows):
            c, req = p.chunk, p.chunk.request
            plps = ()
            if count and logprobs is not None:  # (computed whenever any plan has a count)
                targets = torch.tensor(req.prompt[c.start + 1 : c.start + 1 + count], device=logprobs.device)
                plps = tuple(logprobs[first : first + count].gather(1, targets.unsqueeze(1)).squeeze(1).tolist())
                req.prompt_logprobs.extend(plps)
            # a verify chunk computed its last token and the accepted drafts (emitted - 1 of them)
            req.num_computed = c.start + (len(p.emitted) if p.drafts else c.num_tokens)
            if not p.emitted:
                events.append(TokenEvent(req.request_id, None, None, False, None, plps, req.cached_tokens))
            for i, (tok, lp) in enumerate(p.emitted):
                req.output.append(tok)
                req.logprobs.append(lp)
                req.note_token(tok, core.cfg.eos_token_ids)
                events.append(
                    TokenEvent(
                        req.request_id,
                        tok,
                        lp,
                        req.finished,
                        req.finish_reason,
                        plps if i == 0 else (),
                        req.cached_tokens,
                    )
                )
                if req.finished:
                    break
        return events

    # ---- drafting -----------------------------------------------------------------------------------
    def _draft(self, plans: list[_Plan], streams: torch.Tensor) -> None:
        """The MTP pass over the positions each continuing greedy request just computed, then the chain."""
        core = self.core
        runs = [p for p in plans if not p.chunk.request.finished and p.chunk.request.num_computed > p.chunk.start]
        if not runs:
            return
        last = [
            p
            for p in runs
            if p.chunk.request.num_computed == p.chunk.request.num_tokens - 1 and not p.chunk.request.prefill_only
        ]  # a hand-off drafts on the decode side
        tokens, starts, tables = [], [], []
        hidden_rows: list[int] = []
        for p in runs:
            c, req = p.chunk, p.chunk.request
            tokens.append(req.token_slice(c.start + 1, req.num_computed + 1))  # token t+1 at position t
            starts.append(c.start)
            tables.append(req.pages)
            hidden_rows.extend(range(p.first_row, p.first_row + req.num_computed - c.start))
        ends = torch.tensor([len(t) for t in tokens]).cumsum(0) - 1
        out_rows = [int(ends[i]) for i, p in enumerate(runs) if p in last]
        layer = self.layers[0]
        batch = build_step(core.pool, tokens, starts, tables, [], core.device)
        out = layer.forward(batch, core.pool, streams[torch.tensor(hidden_rows, device=streams.device)])
        decided = self._drafting
        self._drafting = None
        if last and not (decided if decided is not None else self.gate.should_draft(len(last))):
            self.stats["undrafted_steps"] += 1  # the MTP KV above is kept complete: drafting resumes exactly
            return
        if not last:
            return
        hid = out[torch.tensor(out_rows, device=out.device)]
        firsts, qs = self._pick_drafts(layer.logits(hid), last, 0)
        drafts, q = [[t] for t in firsts], [None if r is None else [r] for r in qs]
        self._chain(last, drafts, q, hid)
        self._keep_drafts(last, drafts, q)

    def _keep_drafts(self, plans: list[_Plan], drafts: list, q: list) -> None:
        """Each plan's drafts (and sampled q rows), at most its room, for its next step."""
        for p, d, r in zip(plans, drafts, q):
            room = self._room(p.chunk.request)
            self.drafts[p.chunk.request.request_id] = d[:room]
            if r is not None:
                self.draft_q[p.chunk.request.request_id] = r[:room]

    def _save_chain_rows(self, plans: list[_Plan], n: int) -> list:
        """The MTP layers' ring rows the n - 1 chained steps of `plans` will write (positions P .. P + n - 2)."""
        return spec_rollback.save_requests(
            self.core.pool,
            [p.chunk.request.pages for p in plans],
            [torch.arange(p.chunk.request.num_computed, p.chunk.request.num_computed + n - 1) for p in plans],
            {"swa": [m.layer for m in self.layers]},
        )

    def _pick_drafts(self, logits: torch.Tensor, plans: list[_Plan], j: int) -> tuple[list[int], list]:
        """Draft j of each plan's request from the MTP logits [N, V] -> (tokens, per plan its q row or None):
        argmax for greedy requests, a draw from q (spec_sampling.draw_drafts) for sampled ones."""
        tokens = greedy_pick(logits)[0].long().tolist()
        qs: list[torch.Tensor | None] = [None] * len(plans)
        sampled = [i for i, p in enumerate(plans) if p.chunk.request.params.temperature != 0]
        if sampled:
            reqs = [plans[i].chunk.request for i in sampled]
            rows = torch.tensor(sampled, device=logits.device)
            drawn, q = spec_sampling.draw_drafts(logits[rows], reqs, [len(r.output) + j for r in reqs])
            for n, (i, t) in enumerate(zip(sampled, drawn.tolist())):
                tokens[i], qs[i] = t, q[n]
        return tokens, qs

    def _chain(self, plans: list[_Plan], drafts: list[list[int]], q: list, hid: torch.Tensor) -> None:
        """Drafts 2..K: MTP step j at position P + j - 2 (P = the request's newest position) on its own streams and
        the previous draft; its ring rows are put back afterwards (they hold draft-on-draft KV)."""
        core, n = self.core, max(self._room(p.chunk.request) for p in plans)
        if n <= 1:
            return
        saved = self._save_chain_rows(plans, n)
        for j in range(1, n):
            layer = self.layers[j % len(self.layers)]
            batch = build_step(
                core.pool,
                [[d[-1]] for d in drafts],
                [p.chunk.request.num_computed + j - 1 for p in plans],
                [p.chunk.request.pages for p in plans],
                [],
                core.device,
            )
            hid = layer.forward(batch, core.pool, hid)
            tokens, qs = self._pick_drafts(layer.logits(hid), plans, j)
            for d, r, t, row in zip(drafts, q, tokens, qs):
                d.append(t)
                if r is not None:
                    r.append(row)
        spec_rollback.restore(core.pool, saved)


def _to_host(plans: list[_Plan]) -> None:
    """Plans whose drafts are still on the device get their values (one read) for the varlen step."""
    for p in plans:
        if p.device is not None:
            p.drafts = p.device.values()
            p.tokens = p.tokens[: len(p.tokens) - len(p.drafts)] + p.drafts
            p.device = None


def _still_running(core, req: Request) -> bool:
    """The request is still the engine's and unfinished (not finished by an earlier step, not aborted)."""
    return not req.finished and core.requests.get(req.request_id) is req
