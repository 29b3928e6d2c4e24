"""One speculative decode step on fixed shapes, one host wait (MTP speculative decoding, decode-only steps).

Why: the varlen flow reads the verify step's outcome back to decide acceptance on the host, builds the MTP pass
from it, then reads the drafts back: two waits for the device a step, the device idle while the host works in
between and until the next step is launched. Here everything from the verify step to the next drafts is queued on
the device at once, and the host waits only for the acceptance, while the device goes on with the drafting:
1. the verify step (engine.execution.verify_graphs): request b's last token and its drafts, `queries` rows a slot;
   drafts the previous fixed step left on the device (DeviceDrafts) are written into its tokens there;
2. acceptance on the device. Greedy: the longest prefix of drafts equal to the target's argmax (a cumulative product
   of matches), then the target's token after them. Sampled: rejection sampling (spec_sampling.verify_sampled),
   its accepted prefix likewise. A request without drafts: its one sample. -> emitted tokens [n, q] (request b's
   first n_b = accepted + 1 are real) and their log-probs, whose copy to the host is queued right here;
3. rollback: every ring row the verify step could write is written back where its position was rejected
   (spec_rollback.restore_rejected: a mask computed on the device; accepted rows are rewritten unchanged);
4. the MTP pass on the verify step's bucket, its inputs derived on the device from the verify step's inputs and
   the acceptance (request b's rows: its accepted positions, each with the token emitted after it; the rest
   padding), then the K - 1 chained MTP steps at positions P_b + j - 1 (P_b = start_b + n_b, known only on the
   device), their ring rows saved and restored at rows computed there (spec_rollback.save_rows). Sampled drafts
   are keyed by the output index they decide, which depends on n_b: the host computes the seeds for each
   possible n_b (FixedSpecStep._keyed) and the device picks;
5. the host waits for step 2's copy (the device is busy with step 4 meanwhile), then appends the tokens, finishes
   requests and builds the next step while the drafting runs. The drafts stay on the device (DeviceDrafts) unless
   host code needs their values (a varlen step: one read).
A request that finishes in this step (a stop token or string among its tokens) still had its MTP pass over the
positions it computed: they are its computed positions either way (num_computed counts them), and its drafts are
dropped. Greedy output is the non-speculative output and drafts equal the varlen path's, step by step
(tests/engine/test_spec_mtp_graphs.py); the varlen path stays for steps with prefill chunks, engines without
buckets (decode_mode eager) and shapes no bucket holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.execution import spec_rollback, spec_sampling
from engine.execution.sampling import draw_seed, greedy_pick, sample, sampling_inputs
from engine.model.batch import to_device_nonblocking
from engine.model.verify_batch import VerifyShape


@dataclass(frozen=True)
class FixedOutcome:
    """What the host reads of one fixed step: per plan, its emitted tokens [(token, log-prob)] (accepted drafts and
    the target's next token) and its accepted drafts; and what stays on the device: (when the step drafted) the
    next drafts and, for a sampled request, their q rows (fp32 [V] each)."""

    emitted: list[list[tuple[int, float]]]
    accepted: list[int]
    drafts: torch.Tensor | None  # int64 [steps, n] on the device: column b is plan b's drafts (DeviceDrafts)
    q: list[list[torch.Tensor] | None]


@dataclass(frozen=True)
class DeviceDrafts:
    """One request's drafts still on the device: rows 0..count-1 of column `col` of `picks` (int64 [steps, n], a
    fixed step's drafts). The next fixed step reads them there (its verify tokens and its acceptance), so the host
    never waits for them; `values` reads them (a sync) where host code needs the tokens (the varlen path)."""

    picks: torch.Tensor
    col: int
    count: int

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, cut: slice) -> DeviceDrafts:
        """d[:n] as for a list (only leading cuts: drafts are capped to a request's room)."""
        if cut.start not in (None, 0) or cut.step not in (None, 1):
            raise ValueError(f"DeviceDrafts takes leading cuts only, got {cut}")
        return DeviceDrafts(self.picks, self.col, max(0, min(self.count, self.count if cut.stop is None else cut.stop)))

    def values(self) -> list[int]:
        return [int(t) for t in self.picks[: self.count, self.col].tolist()]


def fill_device_drafts(dst: torch.Tensor, plans: list, q: int, first: int) -> None:
    """Write the device-held drafts of `plans` (their `device` DeviceDrafts) into dst (flat int64 on the device):
    draft j of plan b at b * q + first + j. One gather and one scatter a picks tensor (there is usually one: the
    previous fixed step's)."""
    sources: dict[int, tuple[torch.Tensor, list[int], list[int], list[int]]] = {}
    for b, p in enumerate(plans):
        d = p.device
        if d is None or not d.count:
            continue
        _, cells, rows, cols = sources.setdefault(id(d.picks), (d.picks, [], [], []))
        for j in range(d.count):
            cells.append(b * q + first + j)
            rows.append(j)
            cols.append(d.col)
    for picks, cells, rows, cols in sources.values():
        idx = to_device_nonblocking(torch.tensor([cells, rows, cols], dtype=torch.int64), dst.device)
        dst[idx[0]] = picks[idx[1], idx[2]]


@dataclass(frozen=True)
class HostCopy:
    """A device tensor's copy to the host queued where it is made (pinned, non-blocking, with an event on CUDA), so
    that the work queued after it does not delay its read."""

    host: torch.Tensor
    ready: torch.cuda.Event | None

    @staticmethod
    def of(values: torch.Tensor) -> HostCopy:
        if values.device.type != "cuda":
            return HostCopy(values, None)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return HostCopy(host, ready)

    def values(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    @staticmethod
    def done_event(device: torch.device) -> torch.cuda.Event | None:
        """An event recorded now on the current CUDA stream (None off CUDA): the work queued so far has ended when
        it completes."""
        if device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event


@dataclass(frozen=True)
class LaunchedSpec:
    """A fixed step queued on the device whose tokens the host has not read yet.

    plans: its plans (host side); queries: rows a request; inputs: its verify inputs on the device [3, rows];
    tokens: int64 [n, q] emitted tokens (the first `emitted[b]` of row b are real); drafts: int64 [steps, n] or None;
    qrows: sampled requests' q rows; read: the acceptance's host copy; done: an event after its last work (None on
    the CPU)."""

    plans: list
    queries: int
    inputs: torch.Tensor
    tokens: torch.Tensor
    emitted: torch.Tensor
    drafts: torch.Tensor | None
    qrows: list
    read_copy: HostCopy
    done: torch.cuda.Event | None

    def read(self) -> FixedOutcome:
        """Wait for the acceptance (not for the drafting queued after it) -> the tokens, drafts on the device."""
        n, q = len(self.plans), self.queries
        host = self.read_copy.values()
        tok, lp, acc = host[: n * q], host[n * q : 2 * n * q], host[2 * n * q :]
        emitted = [[(int(tok[b * q + i]), lp[b * q + i]) for i in range(int(acc[b]) + 1)] for b in range(n)]
        return FixedOutcome(emitted, [int(a) for a in acc], self.drafts, self.qrows)

    def wait(self) -> None:
        """Block until all of this step's device work has completed."""
        if self.done is not None:
            self.done.synchronize()

    def next_starts(self) -> torch.Tensor:
        """int64 [n]: each request's first position of the step after this one (its start + its emitted count)."""
        slots, q = self.inputs.shape[1] // self.queries, self.queries
        return self.inputs.view(3, slots, q)[1, : len(self.plans), 0] + self.emitted

    def write_next_inputs(self, packed: torch.Tensor, starts: torch.Tensor, q: int) -> None:
        """The next step's verify inputs on the device, for its requests (this step's, in order) of q rows: token
        rows [last emitted token, drafts...] (the drafts are written by fill_device_drafts), positions from starts
        (next_starts, taken before the next step's inputs were copied: a graph of the same bucket reuses this step's
        input buffer), into packed [3, rows] over the host's placeholders."""
        n = starts.shape[0]
        last = self.tokens.gather(1, (self.emitted - 1).unsqueeze(1)).squeeze(1)
        view = packed.view(3, packed.shape[1] // q, q)
        view[0, :n, 0] = last
        view[1, :n] = starts.unsqueeze(1) + torch.arange(q, device=starts.device)


@dataclass(frozen=True)
class _Shapes:
    queries: int
    chain_steps: int  # MTP steps after the pass (drafts 2..K), 0 when not drafting or K = 1
    chain: VerifyShape | None  # their bucket


class FixedSpecStep:
    """Runs a Speculator's decode-only steps on its VerifyRunner and MtpRunner (module docstring)."""

    def __init__(self, spec):
        self.spec = spec
        self.force_rate: float | None = None  # benchmarks: per-draft acceptance forced after the verify forward
        self._force = torch.Generator().manual_seed(0)
        self._ahead: torch.Tensor | None = None  # the step being launched: see launch
        self._ahead_max = 0

    def force_acceptance(self, rate: float | None, seed: int = 0) -> None:
        """Benchmarks only (benchmarks/spec.py): after the verify forward each draft is compared as if it were the
        target's pick with probability `rate`, else another token (the step's cost stays the real one)."""
        self.force_rate = rate
        self._force = torch.Generator().manual_seed(seed)

    def shapes(self, plans: list, drafting: bool, ahead: int = 0) -> _Shapes | None:
        """The step's queries and chain bucket, or None when no bucket holds it (the caller takes the varlen path).
        ahead: how far past their chunks' starts the requests may start (a step launched before the previous one was
        read: its queries)."""
        spec = self.spec
        q = spec.k + 1 if any(p.drafts for p in plans) else 1
        top = max(p.chunk.start for p in plans) + ahead
        if spec.verify.shape_for(len(plans), top + q, q) is None:
            return None
        # drafts 2..K: as many as the roomiest request may still use after emitting at least one token this step
        room = max(min(spec.k, r.params.max_new_tokens - len(r.output) - 2) for r in (p.chunk.request for p in plans))
        steps = max(room - 1, 0) if drafting else 0
        chain = spec.mtp.chain_shape(len(plans), top + q + steps) if steps else None
        if steps and chain is None:
            return None
        return _Shapes(q, steps, chain)

    @torch.inference_mode()
    def launch(self, plans: list, shapes: _Shapes, drafting: bool, source: LaunchedSpec | None = None) -> LaunchedSpec:
        """Queue the whole step (module docstring) -> its LaunchedSpec (read it for the tokens).

        source: the previous fixed step, not yet read by the host (engine.execution.spec_overlap): this step's
        requests are its requests one step further, each at its start + its emitted count with its last emitted
        token and its drafts as tokens, all taken on the device; `plans` then carry the previous step's starts
        (their chunks are rebased when this step is read) and device drafts of `source`."""
        spec, core = self.spec, self.spec.core
        q, n = shapes.queries, len(plans)
        reqs = [p.chunk.request for p in plans]
        tables = [r.pages for r in reqs]
        starts_host = [p.chunk.start for p in plans]
        starts = None if source is None else source.next_starts()  # int64 [n] on the device
        # output tokens the host has not seen (the unread source's): the draws' keys are offset by them on the device
        self._ahead = None if source is None else source.emitted
        self._ahead_max = 0 if source is None else source.queries
        saved = []
        if q > 1:  # every row a slot could write, kept or put back by the device's verdict below
            if starts is None:
                saved = spec_rollback.save_requests(core.pool, tables, [torch.arange(s, s + q) for s in starts_host])
            else:
                saved = spec_rollback.save_requests_at(
                    core.pool, tables, starts.unsqueeze(1) + torch.arange(q, device=starts.device)
                )
        ids = [r.request_id for r in reqs]
        tokens_in = [p.tokens for p in plans]
        context = None if source is None else max(starts_host) + source.queries + q  # what the starts may reach

        def fill(packed: torch.Tensor) -> None:
            if source is not None and starts is not None:  # (starts: read before packed, which may share its buffer)
                source.write_next_inputs(packed, starts, q)
            fill_device_drafts(packed[0], plans, q, 1)

        out = spec.verify.run(ids, tokens_in, starts_host, tables, q, fill, context)
        assert out is not None and spec.verify.last is not None  # shapes() found its bucket
        step = spec.verify.last
        tokens, lps, accepted = self._accept(plans, out[1], q)
        read = HostCopy.of(torch.cat([tokens.double().reshape(-1), lps.reshape(-1), accepted.double()]))
        emitted = accepted + 1
        if saved:
            spec_rollback.restore_rejected(core.pool, saved, emitted, q)
        self._mtp_pass(step, tokens, emitted, n)
        drafts: torch.Tensor | None = None
        qrows: list[list[torch.Tensor] | None] = [None] * n
        if drafting:
            drafts, qrows = self._draft(plans, step, emitted, shapes)
        return LaunchedSpec(
            plans, q, step.packed, tokens, emitted, drafts, qrows, read, HostCopy.done_event(tokens.device)
        )

    def _keyed(self, seed_of, index: list[int], slots: list[int], extra: torch.Tensor | None = None, spread: int = 0):
        """Draw seeds seed_of(r, index[r] + offset) of rows r (slot slots[r]) -> a list when the host knows every
        index, else int64 [R] on the device: offset = the slot's unread tokens (`_ahead`) + extra[r] (a device count
        of this step, < spread + 1), picked from a table of every possible offset."""
        if self._ahead is None and extra is None:
            return [seed_of(r, i) for r, i in enumerate(index)]
        width = self._ahead_max + spread + 1
        table = torch.tensor(
            [[seed_of(r, i + c) for c in range(width)] for r, i in enumerate(index)], dtype=torch.int64
        )
        dev = (self._ahead if self._ahead is not None else extra).device  # type: ignore[union-attr]
        offset = torch.zeros(len(index), dtype=torch.int64, device=dev)
        if self._ahead is not None:
            offset = offset + self._ahead[to_device_nonblocking(torch.tensor(slots), dev)]
        if extra is not None:
            offset = offset + extra
        return to_device_nonblocking(table, dev).gather(1, offset.unsqueeze(1)).squeeze(1)

    # ---- acceptance ---------------------------------------------------------------------------------
    def _accept(self, plans: list, logits: torch.Tensor, q: int):
        """-> (tokens int64 [n, q], log-probs fp64 [n, q], accepted int64 [n]) on the device."""
        n, dev = len(plans), logits.device
        picks = greedy_pick(logits)  # [2, n * q]: every row's argmax and its log-prob
        tokens, lps = picks[0].long().view(n, q), picks[1].view(n, q)
        if q > 1:  # drafts [n, q - 1], -1 past a request's: the host's, then those still on the device
            pad = [(p.drafts if p.device is None else [0] * len(p.drafts)) for p in plans]
            drafts = torch.tensor([d + [-1] * (q - 1 - len(d)) for d in pad], dtype=torch.int64)
            drafts = to_device_nonblocking(drafts, dev)
            fill_device_drafts(drafts.view(-1), plans, q - 1, 0)
            compared = self._forced(drafts, tokens[:, : q - 1])
            accepted = (compared == tokens[:, : q - 1]).long().cumprod(1).sum(1)
            self._sampled_verify(plans, logits, q, drafts, tokens, lps, accepted)
        else:
            accepted = torch.zeros(n, dtype=torch.int64, device=dev)
        self._plain_samples(plans, logits, q, tokens, lps)
        return tokens, lps, accepted

    def _forced(self, drafts: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
        """Benchmarks: the drafts as compared under force_acceptance (padding -1 stays)."""
        if self.force_rate is None:
            return drafts
        hit = to_device_nonblocking(torch.rand(drafts.shape, generator=self._force) < self.force_rate, drafts.device)
        return torch.where(drafts < 0, drafts, torch.where(hit, picks, picks + 1))

    def _sampled_verify(self, plans, logits, q, drafts, tokens, lps, accepted) -> None:
        """Sampled requests with drafts: rejection sampling over their rows, written over the greedy verdicts.
        drafts: int64 [n, q - 1] on the device, -1 past a request's."""
        todo = [(b, p) for b, p in enumerate(plans) if p.drafts and p.q is not None]
        if not todo:
            return
        dev = logits.device
        flat = [b * q + j for b, p in todo for j in range(len(p.drafts) + 1)]
        cells = [(i, j) for i, (_, p) in enumerate(todo) for j in range(len(p.drafts) + 1)]
        rows = to_device_nonblocking(torch.tensor(flat), dev)
        with_bonus = torch.cat([drafts, drafts.new_full((drafts.shape[0], 1), -1)], dim=1)  # [n, q]: row b*q + j
        zero = logits.new_zeros(1, logits.shape[-1])
        qmat = torch.cat([torch.cat([torch.stack(p.q), zero]) for _, p in todo])
        reqs = [p.chunk.request for _, p in todo for _ in range(len(p.drafts) + 1)]
        index = [len(p.chunk.request.output) + j for _, p in todo for j in range(len(p.drafts) + 1)]
        slots = [b for b, p in todo for _ in range(len(p.drafts) + 1)]
        accept = self._keyed(lambda r, i: spec_sampling.spec_seed(reqs[r].seed, i, spec_sampling.ACCEPT), index, slots)
        emit = self._keyed(lambda r, i: draw_seed(reqs[r].seed, i), index, slots)
        res = spec_sampling.verify_sampled_seeded(logits[rows], with_bonus.view(-1)[rows], qmat, reqs, accept, emit)
        grid = torch.zeros(len(todo), q, dtype=torch.float64, device=dev)  # accepted per (request, row); bonus 0
        at = to_device_nonblocking(torch.tensor(cells).t().contiguous(), dev)
        grid[at[0], at[1]] = res[0]
        first = to_device_nonblocking(torch.tensor([b for b, _ in todo]), dev)
        accepted[first] = grid[:, : q - 1].cumprod(1).sum(1).long()
        tokens.view(-1)[rows] = res[1].long()
        lps.view(-1)[rows] = res[2]

    def _plain_samples(self, plans, logits, q, tokens, lps) -> None:
        """Sampled requests without drafts: their one draw (sampling.draw_requests, keyed as a plain decode step's)."""
        todo = [b for b, p in enumerate(plans) if not p.drafts and p.chunk.request.params.temperature != 0]
        if not todo:
            return
        rows = to_device_nonblocking(torch.tensor([b * q for b in todo]), logits.device)
        reqs = [plans[b].chunk.request for b in todo]
        seeds = self._keyed(lambda r, i: draw_seed(reqs[r].seed, i), [len(r.output) for r in reqs], todo)
        params = [r.params for r in reqs]
        t, k, p, _ = sampling_inputs(
            [x.temperature for x in params],
            [x.top_k for x in params],
            [x.top_p for x in params],
            [0] * len(reqs),
            logits.device,
        )
        sel = logits[rows]
        drawn = sample(sel, t, k, p, seeds, filtered=any(x.top_k > 0 or x.top_p < 1.0 for x in params))
        tokens.view(-1)[rows] = drawn
        lps.view(-1)[rows] = torch.log_softmax(sel, dim=-1).gather(1, drawn.unsqueeze(1)).squeeze(1).double()

    # ---- drafting -----------------------------------------------------------------------------------
    def _mtp_pass(self, step, tokens: torch.Tensor, emitted: torch.Tensor, n: int) -> None:
        """The MTP pass on the verify step's bucket: slot b's first emitted[b] rows are its computed positions, each
        with the token after it (its emitted tokens); the other rows are padding (the padding table row)."""
        shape, dev = step.shape, tokens.device
        slots, q = shape.decode.slots, shape.queries
        inputs = step.packed.view(3, slots, q)
        start, row = inputs[1, :, 0], inputs[2, :, 0]  # a padding slot: position 0, the padding row
        count = torch.ones(slots, dtype=torch.int64, device=dev)
        count[:n] = emitted
        offset = torch.arange(q, device=dev)
        live = offset.unsqueeze(0) < count.unsqueeze(1)
        tok = torch.zeros(slots, q, dtype=torch.int64, device=dev)
        tok[:n] = tokens
        pos = start.unsqueeze(1) + torch.minimum(offset.unsqueeze(0), (count - 1).unsqueeze(1))
        rows = torch.where(live, row.unsqueeze(1), self.spec.verify.decode.block_tables.pad_row)
        packed = torch.stack([tok, pos, rows]).view(3, slots * q)
        select = torch.arange(slots, device=dev) * q + count - 1
        self.spec.mtp.run_pass(step, packed, select)

    def _draft(self, plans: list, step, emitted: torch.Tensor, shapes: _Shapes):
        """Draft 1 from the pass, drafts 2.. by the chain -> (int64 [steps + 1, n] on the device, per plan its q
        rows or None)."""
        mtp, n = self.spec.mtp, len(plans)
        qrows: list = [[] if p.chunk.request.params.temperature != 0 else None for p in plans]
        self._draw_sampled(plans, emitted, qrows, 0)
        picks = [mtp.tokens(n)]
        if shapes.chain_steps:
            assert shapes.chain is not None
            picks += self._chain(plans, step, emitted, shapes, qrows)
        return torch.stack(picks), qrows

    def _chain(self, plans: list, step, emitted: torch.Tensor, shapes: _Shapes, qrows: list) -> list[torch.Tensor]:
        """Chain steps 1..steps at positions P_b + j - 1 (P_b = start_b + emitted_b), their MTP ring rows saved at
        rows computed on the device and put back after (they hold draft-on-draft KV)."""
        spec, pool = self.spec, self.spec.core.pool
        mtp, n, dev, steps = spec.mtp, len(plans), emitted.device, shapes.chain_steps
        assert shapes.chain is not None
        q = step.shape.queries
        inputs = step.packed.view(3, step.shape.decode.slots, q)
        newest = inputs[1, :n, 0] + emitted  # P_b
        window = pool.cfg.sliding_window
        page = pool.groups["swa"].spec.page_rows
        base = torch.tensor([r.pages["swa"][0] * page for r in (p.chunk.request for p in plans)], dtype=torch.int64)
        ring = (
            to_device_nonblocking(base, dev).unsqueeze(1)
            + (newest.unsqueeze(1) + torch.arange(steps, device=dev)) % window
        )
        mtp_layers = tuple(m.layer for m in spec.layers)
        saved = [spec_rollback.save_rows(pool, "swa", mtp_layers, ring.reshape(-1))]
        width = shapes.chain.decode.slots
        pad = spec.verify.decode.block_tables.pad_row
        picks = []
        for j in range(1, steps + 1):
            pos = torch.zeros(width, dtype=torch.int64, device=dev)
            pos[:n] = newest + j - 1
            rows = torch.full((width,), pad, dtype=torch.int64, device=dev)
            rows[:n] = inputs[2, :n, 0]
            mtp.run_chain_step(shapes.chain, j, torch.stack([torch.zeros_like(pos), pos, rows]))
            self._draw_sampled(plans, emitted, qrows, j)
            picks.append(mtp.tokens(n))
        spec_rollback.restore(pool, saved)
        return picks

    def _draw_sampled(self, plans: list, emitted: torch.Tensor, qrows: list, j: int) -> None:
        """Draft j of the sampled requests, drawn from the MTP logits of their slots, put in place of the greedy
        picks (the next chain step reads them); their q rows appended to qrows."""
        sampled = [b for b, r in enumerate(qrows) if r is not None]
        if not sampled:
            return
        mtp, dev = self.spec.mtp, emitted.device
        reqs = [plans[b].chunk.request for b in sampled]
        slots = to_device_nonblocking(torch.tensor(sampled), dev)
        # draft j decides output index len(output) + unread + emitted + j (emitted: this step's count, on the device)
        index = [len(r.output) + 1 + j for r in reqs]
        seeds = self._keyed(
            lambda r, i: spec_sampling.spec_seed(reqs[r].seed, i, spec_sampling.DRAFT),
            index,
            sampled,
            extra=emitted[slots] - 1,
            spread=self.spec.k,
        )
        drawn, dist = spec_sampling.draw_drafts_seeded(mtp.logits(len(plans))[slots], reqs, seeds)
        mtp.set_tokens(sampled, drawn)
        for i, b in enumerate(sampled):
            qrows[b].append(dist[i])
