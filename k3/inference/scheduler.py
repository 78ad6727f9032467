"""The scheduler (SPEC §7): which sequences run this step, on which pages; its plan is plain data.

Each ``schedule()`` fills one step's token budget (``step_tokens``):
1. every running sequence past its prompt decodes one token (a new page when it crosses a page boundary);
2. waiting prompts that fit the rest of the step whole are admitted first (a prefix-cache hit restores their
   first pages and KDA checkpoint), then running prompts continue in chunks (``prefill_chunk`` at most), the
   fewest remaining tokens first, then the other waiting requests are admitted and start theirs. While any
   sequence decodes, prompt tokens per step are capped at ``prefill_cap`` (set by the engine from the measured
   step time, ``k3.inference.pacing``), so a 20K-token prompt delays each decoded token by one capped chunk, not by
   a 2,048-token one, and a short prompt's first token comes after one step (shortest remaining prompt first).
Prompts of ``long_prompt`` tokens or more form the long class: while short requests wait or prefill, long ones
get at most ``long_share`` of the prefill budget and of the pool's pages, so a burst of 1M-token requests cannot
hold back a short request's first token (the report's per-class admission).
Pages are allocated as a sequence grows. When the pool is full, the most recently admitted sequence is
preempted: its pages are freed and it waits again, to be recomputed (its prefix may still be cached).
A chunk ends where the prefix cache wants a KDA checkpoint: every ``checkpoint_every`` hash blocks and at the
last full block of the prompt, so a repeated prompt hits at its last 512-token boundary. It also ends before an
image whose features are not encoded yet (``image_ready``; the engine encodes ``images_to_encode`` a bounded amount
per step), so the sequence waits there while the others run.

``update(plan, sampled)`` then advances the sequences, publishes their completed blocks and checkpoints to the
prefix cache (each step hashes only the blocks it completed) and appends the sampled tokens.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .api import GenerationRequest, PromptImage
from .pool import OutOfPages, PagePool
from .prefix import PrefixCache, extend_hashes


@dataclass(frozen=True)
class SamplingRow:
    temperature: float
    top_k: int
    top_p: float
    seed: int
    step: int  # index of the token being drawn (the noise depends on it)
    logprobs: int = 0


@dataclass(frozen=True)
class PrefillItem:
    seq_id: str
    tokens: list[int]  # this chunk
    start: int  # tokens of the sequence already cached
    mla_pages: list[int]
    kda_pages: list[int]
    sample: SamplingRow | None  # set when the chunk ends the sequence's pending tokens
    images: tuple[PromptImage, ...] = ()  # the prompt's images with placeholder tokens in this chunk


@dataclass(frozen=True)
class DecodeItem:
    seq_id: str
    token: int  # FROM_DEVICE: the token the previous step sampled for this sequence (not yet on the host)
    position: int
    mla_pages: list[int]
    kda_pages: list[int]
    sample: SamplingRow | None  # None: a prompt token fed through the decode path, nothing drawn after it


FROM_DEVICE = -1


@dataclass
class SchedulerOutput:
    prefill: list[PrefillItem] = field(default_factory=list)
    decode: list[DecodeItem] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.decode)


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SchedulerConfig:
    step_tokens: int = 4096
    prefill_chunk: int = 2048
    max_batch: int = 64
    long_prompt: int = 32768
    long_share: float = 0.5
    snapshot_prompt_end: bool = True  # a KDA checkpoint at the last full hash block of every prompt
    decode_prompt_tokens: int = 0  # a prompt remainder this short is fed through the decode path, a token per step


class Sequence:
    """One request's state in the engine. ``tokens`` = prompt + generated; ``num_computed`` of them are in the
    cache; the next forward feeds tokens[num_computed:]. ``in_flight``: tokens sampled by a step whose results
    the host has not read yet (asynchronous scheduling: 0 or 1); they count as pending, and a decode feeds such a
    token straight from the device."""

    def __init__(self, seq_id: str, req: GenerationRequest, seed: int, max_tokens: int, arrival: int, long: bool):
        self.id, self.params, self.seed, self.max_tokens = seq_id, req.params, seed, max_tokens
        self.tokens = list(req.prompt_ids)
        self.prompt_len = len(self.tokens)
        self.images = req.images
        self.media = tuple((im.start, im.start + im.length, im.digest) for im in req.images)  # hashed with blocks
        self.arrival, self.long = arrival, long
        self.num_computed = 0
        self.in_flight = 0
        self.mla_pages: list[int] = []
        self.kda_pages: list[int] = []
        self.hashes: list[bytes] = []  # chain hashes of the full blocks of ``tokens`` (grown as needed)
        self.published = 0  # blocks already given to the prefix cache
        self.cached_tokens = 0
        self.finished = self.aborted = False

    @property
    def pending(self) -> int:
        """Tokens to feed: known ones not yet computed, and the one in flight."""
        return len(self.tokens) + self.in_flight - self.num_computed

    @property
    def generated(self) -> int:
        return len(self.tokens) + self.in_flight - self.prompt_len

    def sampling(self) -> SamplingRow:
        p = self.params
        return SamplingRow(p.temperature, p.top_k, p.top_p, self.seed, p.draw_offset + self.generated, p.logprobs)


class Scheduler:
    def __init__(self, pool: PagePool, prefix: PrefixCache | None, config: SchedulerConfig, hash_block: int,
                 image_ready: Callable[[str, PromptImage], bool] | None = None):
        self.pool, self.prefix, self.cfg, self.hash_block = pool, prefix, config, hash_block
        self.image_ready = image_ready or (lambda seq_id, im: True)  # the runner's: its features are encoded
        self.L = pool.layout
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.prefill_cap: int | None = None  # prompt tokens per step while any sequence decodes (None: no cap)
        self._arrivals = itertools.count()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def next_arrival(self) -> int:
        return next(self._arrivals)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the plan -------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.step_tokens
        self.running.sort(key=lambda s: s.arrival)  # earlier arrivals first; preemption takes the latest
        for seq in list(self.running):
            if seq.pending == 1 and seq in self.running and budget > 0:
                if self._grow(seq, 1, out):
                    out.decode.append(self._decode_item(seq))
                    budget -= 1
        if out.decode and self.prefill_cap is not None:
            budget = min(budget, self.prefill_cap)  # decoding streams wait for this step: keep it short
        short_waiting = any(not s.long for s in self.waiting) or any(
            not s.long and s.pending > 1 for s in self.running)
        long_budget = int(budget * self.cfg.long_share) if short_waiting else budget
        for cls_long in (False, True):
            for whole in (True, False):  # waiting prompts that fit whole, then running chunks, then the rest
                if not whole:
                    planned = {it.seq_id for it in [*out.prefill, *out.decode]}  # admitted whole just now
                    for seq in sorted((s for s in self.running if s.long == cls_long and s.pending > 1
                                       and s.id not in planned), key=lambda s: s.pending):
                        budget, long_budget = self._chunk(seq, out, budget, long_budget)
                budget, long_budget = self._admit_waiting(cls_long, whole, out, budget, long_budget)
        return out

    def _admit_waiting(self, cls_long: bool, whole: bool, out: SchedulerOutput, budget: int,
                       long_budget: int) -> tuple[int, int]:
        """Admit waiting requests of one class in arrival order; ``whole``: only those whose prompt fits the rest
        of this step (and one chunk) whole, passing over the others."""
        for seq in [s for s in self.waiting if s.long == cls_long]:
            if budget <= 0 or len(self.running) >= self.cfg.max_batch:
                break
            if whole and seq.pending > min(budget, self.cfg.prefill_chunk):
                continue
            if seq.long and (long_budget <= 0 or not self._long_pages_ok(seq)):
                break
            if not self._admit(seq):
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            budget, long_budget = self._chunk(seq, out, budget, long_budget)
        return budget, long_budget

    def _decode_item(self, seq: Sequence) -> DecodeItem:
        token = FROM_DEVICE if seq.in_flight else seq.tokens[-1]
        return DecodeItem(seq.id, token, seq.num_computed, list(seq.mla_pages), list(seq.kda_pages),
                          seq.sampling())

    def _chunk(self, seq: Sequence, out: SchedulerOutput, budget: int, long_budget: int) -> tuple[int, int]:
        if self._feeds_by_decode(seq):  # e.g. the few tokens after a prefix hit: one decode row, not a prefill
            if budget <= 0 or (seq.long and long_budget <= 0) or not self._grow(seq, 1, out):
                return budget, long_budget
            last = seq.num_computed + 1 == len(seq.tokens)
            out.decode.append(DecodeItem(seq.id, seq.tokens[seq.num_computed], seq.num_computed, list(seq.mla_pages),
                                         list(seq.kda_pages), seq.sampling() if last else None))
            return budget - 1, long_budget - 1 if seq.long else long_budget
        # known tokens only: a preempted sequence's in-flight token joins it at the next step
        n = min(len(seq.tokens) - seq.num_computed, self.cfg.prefill_chunk, budget, long_budget if seq.long else budget)
        n = min(n, self._next_snapshot(seq) - seq.num_computed, self._image_barrier(seq) - seq.num_computed)
        if n <= 0 or not self._grow(seq, n, out):
            return budget, long_budget
        done = n == seq.pending
        lo, hi = seq.num_computed, seq.num_computed + n
        images = tuple(im for im in seq.images if im.start < hi and im.start + im.length > lo)
        out.prefill.append(PrefillItem(seq.id, seq.tokens[lo:hi], lo, list(seq.mla_pages), list(seq.kda_pages),
                                       seq.sampling() if done else None, images))
        return budget - n, long_budget - n if seq.long else long_budget

    def _feeds_by_decode(self, seq: Sequence) -> bool:
        """The rest of the prompt goes through the decode path (CUDA graphs: a few replays cost less than one eager
        prefill forward): at most ``decode_prompt_tokens`` known tokens, nothing in flight, no image among them."""
        rest = len(seq.tokens) - seq.num_computed
        return (0 < rest <= self.cfg.decode_prompt_tokens and not seq.in_flight
                and not any(im.start + im.length > seq.num_computed for im in seq.images))

    def _image_barrier(self, seq: Sequence) -> int:
        """Where this sequence's prefill must stop for now: the start of its first image not yet prefilled whose
        features are not encoded yet (the engine encodes them a bounded amount per step), else the end."""
        for im in seq.images:
            if im.start + im.length > seq.num_computed and not self.image_ready(seq.id, im):
                return im.start
        return len(seq.tokens)

    def images_to_encode(self) -> list[tuple[str, PromptImage]]:
        """(sequence id, image) of the running sequences, earlier arrivals first: each one's first image not
        prefilled yet whose features are not encoded yet (what holds, or will hold, its prefill back)."""
        out = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            im = next((im for im in seq.images if im.start + im.length > seq.num_computed
                       and not self.image_ready(seq.id, im)), None)
            if im is not None:
                out.append((seq.id, im))
        return out

    def _next_snapshot(self, seq: Sequence) -> int:
        """The next token count after num_computed at which the prefix cache wants this sequence's KDA state."""
        if self.prefix is None or not self.L.n_kda:
            return len(seq.tokens)
        span = self.hash_block * self.prefix.checkpoint_every
        nxt = (seq.num_computed // span + 1) * span
        end = (seq.prompt_len // self.hash_block) * self.hash_block
        if self.cfg.snapshot_prompt_end and seq.num_computed < end < nxt:
            nxt = end
        return nxt

    # ---- pages ------------------------------------------------------------------------------------------------
    def _grow(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Pages for tokens [num_computed, num_computed + n); preempts later arrivals when the pool is full (and
        drops what this step's plan had for them). False (nothing allocated) if even that cannot make room."""
        need = self.L.mla_pages(seq.num_computed + n) - len(seq.mla_pages)
        if need <= 0:
            return True
        while True:
            try:
                seq.mla_pages += self.pool.alloc(need)
                return True
            except OutOfPages:
                victim = self._victim(seq)
                if victim is None:
                    return False
                self.preempt(victim)
                out.decode = [it for it in out.decode if it.seq_id != victim.id]
                out.prefill = [it for it in out.prefill if it.seq_id != victim.id]

    def _victim(self, seq: Sequence) -> Sequence | None:
        later = [s for s in self.running if s.arrival > seq.arrival and s.mla_pages + s.kda_pages]
        return max(later, key=lambda s: s.arrival) if later else None

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s pages and put it back at the head of the queue: it will be recomputed."""
        self.pool.decref(seq.mla_pages + seq.kda_pages)
        seq.mla_pages, seq.kda_pages, seq.num_computed, seq.published = [], [], 0, 0
        self.preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _long_pages_ok(self, seq: Sequence) -> bool:
        held = sum(len(s.mla_pages) + len(s.kda_pages) for s in self.running if s.long)
        short_waiting = any(not s.long for s in self.waiting)
        return not short_waiting or held < self.cfg.long_share * self.pool.usable

    def _admit(self, seq: Sequence) -> bool:
        """KDA pages (zeroed, or the prefix hit's checkpoint) and the hit's MLA pages; False if they do not fit."""
        extend_hashes(seq.hashes, seq.tokens, self.hash_block, media=seq.media)
        hit = self.prefix.lookup(seq.hashes, seq.pending - 1) if self.prefix is not None else None
        if hit is not None and hit.tokens:
            pinned = [x.page for x in hit.blocks + hit.checkpoint if x.page is not None and x.page >= 0]
            self.pool.incref(pinned)  # nothing we read may be evicted by the allocations below
            try:
                if self.pool.available < self.L.mla_pages(hit.tokens) + self.L.kda_pages:
                    return False
                seq.mla_pages = self.prefix.materialize(hit)
                seq.kda_pages = self.pool.alloc(self.L.kda_pages)
                self.prefix.restore_checkpoint(hit, seq.kda_pages)
            finally:
                self.pool.decref(pinned)
            seq.num_computed = seq.cached_tokens = hit.tokens
            self.prefix.insert_blocks(seq.hashes[: hit.tokens // self.hash_block], seq.mla_pages)
            seq.published = hit.tokens // self.hash_block
            return True
        try:
            seq.kda_pages = self.pool.alloc(self.L.kda_pages)
        except OutOfPages:
            return False
        self.pool.zero_kda(seq.kda_pages)
        return True

    def finish(self, seq: Sequence) -> None:
        if seq.finished:
            return
        seq.finished = True
        self.pool.decref(seq.mla_pages + seq.kda_pages)
        seq.mla_pages, seq.kda_pages = [], []
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    # ---- after the forward ------------------------------------------------------------------------------------
    def update(self, plan: SchedulerOutput, seqs: dict[str, Sequence]) -> None:
        """Advance the sequences the plan ran (those still open); publish their completed blocks and checkpoints.
        Called once the tokens the plan fed are all on the host (an in-flight token fed by a decode has been
        delivered), so block hashes see real tokens."""
        for it in [*plan.prefill, *plan.decode]:
            seq = seqs.get(it.seq_id)  # None: finished by the tokens delivered since the plan was launched
            if seq is not None:
                self._advance(seq, len(it.tokens) if isinstance(it, PrefillItem) else 1)

    def _advance(self, seq: Sequence, n: int) -> None:
        seq.num_computed += n
        if self.prefix is None:
            return
        full = seq.num_computed // self.hash_block
        if full > seq.published:
            extend_hashes(seq.hashes, seq.tokens[: full * self.hash_block], self.hash_block, media=seq.media)
            self.prefix.insert_blocks(seq.hashes[:full], seq.mla_pages, seq.published)
            seq.published = full
        if self.L.n_kda and seq.num_computed % self.hash_block == 0 and seq.num_computed > 0 and (
                self.prefix.is_checkpoint_boundary(seq.num_computed) or seq.num_computed == (
                seq.prompt_len // self.hash_block) * self.hash_block):
            self._snapshot(seq)

    def _snapshot(self, seq: Sequence) -> None:
        try:
            pages = self.pool.alloc(self.L.kda_pages)
        except OutOfPages:
            return  # the cache is only an optimisation
        self.pool.copy_pages(seq.kda_pages, pages)
        self.prefix.insert_checkpoint(seq.hashes[seq.num_computed // self.hash_block - 1], pages)
        self.pool.decref(pages)  # now owned by the cache alone (evictable)
