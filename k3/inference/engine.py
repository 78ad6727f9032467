"""The inference engine (SPEC §7): continuous batching over one hybrid paged cache with KDA-aware prefix reuse.

Each ``step()``: admit waiting requests whose pages fit (a prefix-cache hit shares or copies the cached pages
and restores the KDA checkpoint), run ONE prefill chunk (chunks end at KDA checkpoint boundaries, where the
state is snapshotted into the prefix cache), then ONE batched decode token for every sequence past its
prompt. Requests join and leave between steps. ``submit`` + ``start`` run the same loop on a thread.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from dataclasses import dataclass

import torch

from ..layers.sequence.kda import KDAState
from .api import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from .cache import BlockPool, CacheLayout, OutOfPages, PrefixCache
from .detok import IncrementalDetokenizer, StopMatcher
from .sampler import make_generator, sample
from .step_cache import StepCache


@dataclass(frozen=True)
class EngineConfig:
    num_pages: int = 512
    page_tokens: int = 1024  # MLA tokens per physical page (a multiple of hash_block)
    hash_block: int = 512  # prefix-hash granularity
    checkpoint_every: int = 4  # KDA checkpoint every this many hash blocks
    prefill_chunk: int = 2048
    max_batch: int = 64
    max_context: int | None = None  # default: the model's max_position_embeddings or 1M
    prefix_cache: bool = True
    dtype: torch.dtype | None = None  # cache dtype; default: the model's


class _Seq:
    def __init__(self, rid, req: GenerationRequest, tok, handle, device):
        self.id, self.req, self.handle = rid, req, handle
        self.tokens = list(req.prompt_ids)
        self.prompt_len = len(self.tokens)
        self.num_cached = 0  # tokens whose MLA latents are in the pages and whose effect is in the KDA state
        self.mla_pages: list[int] = []
        self.kda_pages: list[int] = []
        self.cached_tokens = 0
        p = req.params
        self.gen = make_generator(p, device)  # on the logits' device: a CPU generator cannot draw CUDA noise
        self.detok, self.stop = IncrementalDetokenizer(tok), StopMatcher(p.stop)
        self.text, self.out_ids, self.finished, self.aborted = "", [], False, False

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prompt_len


class RequestHandle:
    """Iterate for the request's events (blocking); ``cancel()`` aborts it and frees its cache."""

    def __init__(self, engine: "Engine", rid: str):
        self.engine, self.id = engine, rid
        self.events: queue.Queue = queue.Queue()

    def __iter__(self):
        while True:
            ev = self.events.get()
            yield ev
            if isinstance(ev, FinishEvent):
                return

    def cancel(self) -> None:
        self.engine.abort(self.id)


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig(), model_name: str = "k3"):
        from ..data.tokenizer import eos_id

        self.model, self.tokenizer, self.cfg, self.model_name = model.eval(), tokenizer, config, model_name
        mc = model.config
        self.device = next(model.parameters()).device
        dtype = config.dtype or next(model.parameters()).dtype
        self.layout = CacheLayout.from_config(mc, config.page_tokens, dtype)
        self.pool = BlockPool(self.layout, config.num_pages, self.device)
        self.prefix = PrefixCache(self.pool, config.hash_block, config.checkpoint_every) if config.prefix_cache else None
        self.kda_slot = {i: s for s, i in enumerate(i for i in range(mc.num_hidden_layers) if mc.layer_kind(i) == "kda")}
        self.mla_slot = {i: s for s, i in enumerate(i for i in range(mc.num_hidden_layers) if mc.layer_kind(i) == "mla")}
        self.max_context = config.max_context or mc.max_position_embeddings
        self.eos = eos_id(tokenizer)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.seqs: dict[str, _Seq] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False

    # ---- requests -----------------------------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> RequestHandle:
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n + req.params.max_tokens > self.max_context:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({req.params.max_tokens}) exceeds the context "
                             f"limit of {self.max_context} tokens")
        need = self.layout.mla_pages(n + req.params.max_tokens) + self.layout.kda_pages
        if need > self.pool.num_pages:
            raise ValueError(f"this request needs {need} cache pages but the pool has {self.pool.num_pages}; "
                             f"start the engine with more pages or ask for fewer tokens")
        with self._lock:
            rid = req.request_id or f"req-{next(self._ids)}"
            handle = RequestHandle(self, rid)
            seq = _Seq(rid, req, self.tokenizer, handle, self.device)
            self.seqs[rid] = seq
            self.waiting.append(seq)
        self._wake.set()
        return handle

    def abort(self, rid: str) -> None:
        with self._lock:
            seq = self.seqs.get(rid)
            if seq is not None and not seq.finished:
                seq.aborted = True
        self._wake.set()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[FinishEvent]:
        """Blocking helper without a thread: run steps until every prompt is done."""
        ps = params if isinstance(params, list) else [params] * len(prompts)
        handles = [self.submit(GenerationRequest(tuple(p), q)) for p, q in zip(prompts, ps)]
        seqs = [self.seqs[h.id] for h in handles]
        while any(not s.finished for s in seqs):
            self.step()
        return [list(h)[-1] for h in handles]

    def stats(self) -> dict:
        """Queue and cache occupancy (the server's /health reports it)."""
        return {"running": len(self.running), "waiting": len(self.waiting), "pages_in_use": self.pool.pages_in_use,
                "pages_total": self.pool.num_pages, "prefix_checkpoints": self.prefix.num_checkpoints if self.prefix else 0}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the loop -----------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the loop thread and end every open request with FinishEvent("abort")."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with self._lock:
            for seq in self.running + list(self.waiting):
                self._finish(seq, "abort")

    def _loop(self) -> None:
        while not self._stop:
            if not self.has_work:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self.step()

    @torch.no_grad()
    def step(self) -> None:
        with self._lock:
            for seq in [s for s in self.running + list(self.waiting) if s.aborted]:
                self._finish(seq, "abort")
            self._admit()
        prefill = next((s for s in self.running if s.in_prefill), None)
        if prefill is not None:
            self._prefill_chunk(prefill)
        decode = [s for s in self.running if not s.in_prefill and not s.finished]
        if decode:
            self._decode(decode)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_batch:
            seq = self.waiting[0]
            try:
                self._allocate(seq)
            except OutOfPages:
                return  # wait for running requests to finish and free pages
            self.waiting.popleft()
            self.running.append(seq)

    def _allocate(self, seq: _Seq) -> None:
        L, total = self.layout, seq.prompt_len + seq.req.params.max_tokens
        hit = self.prefix.lookup(seq.tokens, seq.prompt_len - 1) if self.prefix is not None else None
        if hit is not None and hit.tokens:
            pinned = hit.block_pages + hit.kda_pages
            self.pool.incref(pinned)  # nothing we read may be evicted by the allocations below
            try:
                pages = self.prefix.materialize(hit)
                try:
                    rest = self.pool.alloc(L.mla_pages(total) - len(pages) + L.kda_pages)
                except OutOfPages:
                    self.pool.decref(pages)
                    raise
                for src, dst in zip(hit.kda_pages, rest[len(rest) - L.kda_pages:]):
                    self.pool.copy_page(src, dst)
            finally:
                self.pool.decref(pinned)
            seq.mla_pages = pages + rest[: len(rest) - L.kda_pages]
            seq.kda_pages = rest[len(rest) - L.kda_pages:]
            seq.num_cached = seq.cached_tokens = hit.tokens
        else:
            pages = self.pool.alloc(L.mla_pages(total) + L.kda_pages)
            seq.mla_pages, seq.kda_pages = pages[: L.mla_pages(total)], pages[L.mla_pages(total):]
            if L.n_kda:
                dev = self.pool.data.device
                self.pool.write_kda(seq.kda_pages, torch.zeros(L.n_kda, L.kda_heads, L.kda_dim, L.kda_dim, device=dev),
                                    torch.zeros(L.n_kda, 3, L.kda_heads * L.kda_dim, L.conv_width - 1, device=dev))

    # ---- model calls --------------------------------------------------------------------------------------
    def _forward(self, seqs: list[_Seq], new: torch.Tensor) -> torch.Tensor:
        """new [B,T] token ids after each sequence's cached tokens -> logits [B,T,V]; writes the cache back."""
        L, dev = self.layout, self.device
        B, T = new.shape
        ctx = torch.tensor([s.num_cached for s in seqs], device=dev)
        S = max(s.num_cached for s in seqs)  # from the host's copy: no device sync
        kda_in, mla_in = {}, {}
        if L.n_kda:
            states, conv = self.pool.read_kda_batch([s.kda_pages for s in seqs])  # [n_kda,B,H,K,K], [n_kda,3,B,HK,W-1]
            for i, slot in self.kda_slot.items():
                kda_in[i] = KDAState(states[slot], conv[slot, 0], conv[slot, 1], conv[slot, 2])
        if L.n_mla:
            lat = self.pool.read_mla_batch([s.mla_pages for s in seqs], [s.num_cached for s in seqs], S)
            R = self.model.config.kv_lora_rank
            for i, slot in self.mla_slot.items():
                mla_in[i] = (lat[:, :, slot, :R], lat[:, :, slot, R:])
        cache = StepCache(kda_in, mla_in, ctx, T)
        logits = self.model(new.to(dev), cache=cache)["logits"]
        if L.n_kda:
            st = torch.stack([cache.kda_out[i].recurrent for i in self.kda_slot], 0)  # [n_kda,B,H,K,K]
            cv = torch.stack([torch.stack([cache.kda_out[i].conv_q, cache.kda_out[i].conv_k, cache.kda_out[i].conv_v])
                              for i in self.kda_slot], 0)  # [n_kda,3,B,HK,W-1]
            self.pool.write_kda_batch([s.kda_pages for s in seqs], st, cv)
        if L.n_mla:
            new_lat = torch.stack([torch.cat(cache.mla_new[i], dim=-1) for i in self.mla_slot], 2)  # [B,T,n_mla,lat]
            if T == 1:  # a decode step: one token per sequence, one scatter
                self.pool.write_mla_tokens([s.mla_pages for s in seqs], [s.num_cached for s in seqs], new_lat[:, 0])
            else:
                for b, s in enumerate(seqs):
                    self.pool.write_mla(s.mla_pages, s.num_cached, new_lat[b])
        for s in seqs:
            s.num_cached += T
        return logits

    def _prefill_chunk(self, seq: _Seq) -> None:
        end = min(seq.prompt_len, seq.num_cached + self.cfg.prefill_chunk)
        if self.prefix is not None:  # stop at the next checkpoint boundary so the KDA state can be kept there
            span = self.prefix.hash_block * self.prefix.checkpoint_every
            end = min(end, (seq.num_cached // span + 1) * span)
        ids = torch.tensor([seq.tokens[seq.num_cached: end]])
        logits = self._forward([seq], ids)
        self._remember(seq)
        if not seq.in_prefill:
            self._emit(seq, logits[0, -1])

    def _decode(self, seqs: list[_Seq]) -> None:
        ids = torch.tensor([[s.tokens[-1]] for s in seqs])
        logits = self._forward(seqs, ids)
        for s in seqs:
            self._remember(s)
        self._emit_batch(seqs, logits[:, -1])

    def _remember(self, seq: _Seq) -> None:
        """Publish the sequence's computed fine blocks and, at a checkpoint boundary, a copy of its KDA state."""
        if self.prefix is None:
            return
        self.prefix.insert_blocks(seq.tokens, seq.mla_pages, seq.num_cached)
        if self.layout.n_kda and self.prefix.is_checkpoint_boundary(seq.num_cached):
            try:
                pages = self.pool.alloc(self.layout.kda_pages)
            except OutOfPages:
                return  # the cache is only an optimisation
            for src, dst in zip(seq.kda_pages, pages):
                self.pool.copy_page(src, dst)
            self.prefix.insert_checkpoint(seq.tokens, seq.num_cached, pages)
            self.pool.decref(pages)  # now owned by the cache alone (evictable)

    # ---- sampling and events ------------------------------------------------------------------------------
    def _emit(self, seq: _Seq, logits: torch.Tensor) -> None:
        self._emit_batch([seq], logits[None])

    def _emit_batch(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        """Sample the next token of every sequence from logits [B, V] in one call (each row with its own
        parameters and generator), bring the tokens to the host once, then deliver them one by one."""
        tok, lp, top = sample(logits.float(), [s.req.params for s in seqs], [s.gen for s in seqs])
        for seq, t, logprob, top_i in zip(seqs, tok.tolist(), lp.tolist(), top):
            self._deliver(seq, t, logprob, top_i)

    def _deliver(self, seq: _Seq, t: int, logprob: float, top) -> None:
        p = seq.req.params
        is_eos = t == self.eos
        delta = ""
        if not is_eos:
            seq.tokens.append(t)
            seq.out_ids.append(t)
            delta = seq.detok.push(t)
        text, stopped = seq.stop.feed(delta)
        final = stopped or is_eos or len(seq.out_ids) >= p.max_tokens
        if final and not stopped:  # release what was held back: an incomplete character, a possible stop string
            more, stopped = seq.stop.feed(seq.detok.flush())
            text += more if stopped else more + seq.stop.flush()
        seq.text += text
        if not is_eos or text:  # EOS itself is no output; its event only carries text held back until now
            seq.handle.events.put(TokenEvent(t, text, logprob, tuple((int(i), float(v)) for i, v in top)))
        if final:
            self._finish(seq, "stop" if stopped or is_eos else "length")

    def _finish(self, seq: _Seq, reason: str) -> None:
        if seq.finished:
            return
        seq.finished = True
        self.pool.decref(seq.mla_pages + seq.kda_pages)
        seq.mla_pages, seq.kda_pages = [], []
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.seqs.pop(seq.id, None)
        seq.handle.events.put(FinishEvent(reason, seq.prompt_len, len(seq.out_ids), seq.cached_tokens, seq.text))
