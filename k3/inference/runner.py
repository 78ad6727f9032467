"""The model runner (SPEC §7): device buffers, the forward of a scheduler plan, sampling; the only part of the
engine that touches the device. CUDA graphs are captured here and nowhere else.

Legend: N prefill sequences, T packed prefill tokens, B decode rows, Bb the CUDA-graph bucket B is padded to,
P max pages per sequence, V vocabulary, K reported alternatives.

- Prefill: the plan's chunks of N sequences run as one packed row (``PrefillMixer``); logits only at the last
  token of sequences whose prompt is complete. A chunk holding image placeholder tokens (a model with a vision
  tower: ``encode_image_pieces``) gets the image's features there instead of the placeholder's embedding
  (``ImageFeatures``, k3.inference.images: encoded in bounded pieces between steps, before the image is scheduled).
- Decode: one token per row (``DecodeMixer``: state and latents read and written in place). On CUDA with a
  bf16/fp16 model the forward and the sampler are captured as CUDA graphs per batch-size bucket (1, 2, 4, ...,
  256) over static buffers; a step copies its inputs into those buffers (three host-to-device copies), replays
  two graphs and brings the sampled tokens back in one non-blocking device-to-host copy (``launch`` returns at
  once; ``StepResult.wait`` reads them). The sampled tokens also stay on the device: a decode row whose token the
  host has not seen yet (``FROM_DEVICE``, asynchronous scheduling) reads it from there. With ``compile`` the forward is
  ``torch.compile``d first (the custom decode kernels stay opaque). Padded rows of a bucket read and write the
  pool's scratch page only.
"""

from __future__ import annotations

import torch

from ..ops.grouped_mm import fused_dtypes
from ..ops.moe_decode import DECODE_ROWS
from .images import ImageFeatures
from .mixers import DecodeMixer, PrefillMixer, register_pool, release_pool
from .pool import PagePool
from .sampler import TOP_LOGPROBS, sample
from .scheduler import FROM_DEVICE, DecodeItem, PrefillItem, Sampled, SamplingRow, SchedulerOutput

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
N_INT = 6  # int64 inputs of a decode row before its KDA pages: token, position, top_k, seed, step, source row


class StepResult:
    """A launched step's sampled tokens: ``wait()`` -> {seq id: Sampled}. On CUDA the results come back through a
    non-blocking copy into pinned memory, so the host can plan the next step while the device runs this one."""

    def __init__(self, host: torch.Tensor | None, event, ids: list[str], wants: list[int]):
        self.host, self.event, self.ids, self.wants = host, event, ids, wants

    def wait(self) -> dict[str, Sampled]:
        if self.host is None:
            return {}
        if self.event is not None:
            self.event.synchronize()
        return _unpack(self.host, self.ids, self.wants)


def _pack(tokens, lp, top_lp, top_id) -> torch.Tensor:
    """[B, 2 + 2K] fp32: token id, its logprob, K alternatives' logprobs and ids (ids < 2^24: exact in fp32)."""
    return torch.cat([tokens[:, None].float(), lp[:, None], top_lp, top_id.float()], dim=1)


def _unpack(packed: torch.Tensor, ids: list[str], wants: list[int]) -> dict[str, Sampled]:
    K = (packed.shape[1] - 2) // 2
    rows = packed.tolist()
    out = {}
    for sid, row, want in zip(ids, rows, wants):
        if sid is None:  # a row that fed a prompt token: nothing drawn
            continue
        top = tuple((int(row[2 + K + j]), float(row[2 + j])) for j in range(min(want, K)))
        out[sid] = Sampled(int(row[0]), float(row[1]), top)
    return out


FEED_ONLY = SamplingRow(0.0, 0, 1.0, 0, 0)  # the sampling row of a decode row that only feeds a prompt token


def _row(it) -> SamplingRow:
    return it.sample if it.sample is not None else FEED_ONLY


def _sampling_kind(items) -> tuple[bool, bool]:
    """(filtered: some row has top-k or top-p, top: some row asks for logprobs): which sampler variant the rows
    need (a CUDA graph each, per bucket)."""
    rows = [_row(it) for it in items]
    return any(r.top_k > 0 or r.top_p < 1.0 for r in rows), any(r.logprobs > 0 for r in rows)


class ModelRunner:
    def __init__(self, model, pool: PagePool, max_context: int, max_batch: int, cuda_graphs: bool | None = None,
                 compile: bool | None = None, graph_sizes=GRAPH_SIZES):
        self.model, self.pool = model, pool
        self.lm = getattr(model, "language_model", model)  # the text model (K3ForConditionalGeneration wraps one)
        self.images = ImageFeatures(model, pool.data.device)  # the prompts' image features (k3.inference.images)
        self.key = register_pool(pool)
        mc = model.config
        kinds = [mc.layer_kind(i) for i in range(mc.num_hidden_layers)]
        self.kda_slot = {i: s for s, i in enumerate(i for i, k in enumerate(kinds) if k == "kda")}
        self.mla_slot = {i: s for s, i in enumerate(i for i, k in enumerate(kinds) if k == "mla")}
        self.device = pool.data.device
        L = pool.layout
        self.max_pages = max(1, L.mla_pages(max_context + 1))
        dtype = next(model.parameters()).dtype
        cuda = self.device.type == "cuda"
        # a captured step must never wait for the host: the experts' grouped matmul is one fused call in bf16 only,
        # but a decode batch of at most DECODE_ROWS routed rows takes the fused decode kernels in any dtype
        fused_decode = max_batch * model.config.num_experts_per_token <= DECODE_ROWS
        if cuda_graphs and not (cuda and (dtype in fused_dtypes() or fused_decode)):
            raise ValueError(f"CUDA graphs need a CUDA device and either a {' or '.join(map(str, fused_dtypes()))} "
                             f"model or max_batch x experts per token <= {DECODE_ROWS} (the experts' grouped matmul "
                             f"must not wait for the host); got {self.device}, {dtype} and max_batch {max_batch}: "
                             "pass cuda_graphs=False, load the model in bf16 or lower max_batch")
        self.use_graphs = (cuda and dtype in fused_dtypes()) if cuda_graphs is None else cuda_graphs
        self.compile = self.use_graphs if compile is None else compile
        self.sizes = sorted({s for s in graph_sizes if s < max_batch} | {max_batch})
        self._forward, self._sample = self._decode_logits, sample
        if self.compile:
            self._forward = torch.compile(self._decode_logits, dynamic=True)
            self._sample = torch.compile(sample, dynamic=True)
        # the tokens the last launched step sampled, by row (prefill rows first), and each row's sequence: a decode
        # row whose token is FROM_DEVICE reads it here (a static buffer: CUDA graphs read it by address)
        self._prev_tokens = torch.zeros(max(max_batch, max(self.sizes)), dtype=torch.long, device=self.device)
        self._prev_row: dict[str, int] = {}
        self._flip = 0
        if self.device.type == "cuda":
            self._host_result = [torch.zeros(len(self._prev_tokens), 2 + 2 * TOP_LOGPROBS).pin_memory()
                                 for _ in range(2)]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._sample_graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        if self.use_graphs:
            self._static_buffers(max(self.sizes), L.kda_pages)

    def close(self) -> None:
        release_pool(self.key)

    # ---- the plan ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, plan: SchedulerOutput) -> dict[str, Sampled]:
        """Run ``plan`` and wait for its sampled tokens."""
        return self.launch(plan).wait()

    @torch.no_grad()
    def launch(self, plan: SchedulerOutput) -> StepResult:
        """Enqueue ``plan`` on the device; the sampled tokens stay on the device too (the next step's decode rows
        of these sequences read them there: ``FROM_DEVICE``) and come back to the host in one non-blocking copy."""
        parts, rows = [], []
        if plan.prefill:
            want = [it for it in plan.prefill if it.sample is not None]
            logits = self.prefill_logits(plan.prefill)
            if want:
                parts.append(self._sample_packed(logits, want))
                rows += want
        if plan.decode:
            logits = self.decode_logits(plan.decode)
            parts.append(self._sample_graphed(plan.decode) if self.use_graphs
                         else self._sample_packed(logits, plan.decode))
            rows += plan.decode
        if not rows:
            return StepResult(None, None, [], [])
        packed = parts[0] if len(parts) == 1 else torch.cat(parts)  # [n, 2 + 2K] fp32
        n = len(rows)
        self._prev_tokens[:n].copy_(packed[:, 0])  # after this step's forwards: they read the previous step's
        self._prev_row = {it.seq_id: i for i, it in enumerate(rows) if it.sample is not None}
        ids = [it.seq_id if it.sample is not None else None for it in rows]
        wants = [it.sample.logprobs if it.sample is not None else 0 for it in rows]
        if self.device.type != "cuda":
            return StepResult(packed, None, ids, wants)
        self._flip ^= 1  # two pinned buffers: this step's copy never overwrites the one the host may be reading
        host = self._host_result[self._flip][:n]
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return StepResult(host, event, ids, wants)

    def prefill_logits(self, items: list[PrefillItem]) -> torch.Tensor:
        """Run the chunks of ``items`` (their state and latents go into the pool); the next-token logits [n,V] fp32
        of the items whose chunk ends their pending tokens (``sample`` set), in order."""
        dev, Tp = self.device, self.pool.layout.page_tokens
        lengths = [len(it.tokens) for it in items]
        starts = [it.start for it in items]
        ids = torch.tensor([t for it in items for t in it.tokens], device=dev)[None]
        cu = torch.tensor([0] + lengths, dtype=torch.long).cumsum(0)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
        slots, context = [], []
        if self.mla_slot:
            for it, s, n in zip(items, starts, lengths):
                pages = torch.tensor(it.mla_pages, dtype=torch.long)
                pos = torch.arange(s + n)
                ctx = pages[pos // Tp] * Tp + pos % Tp  # the flat slot of every token of the context
                context.append(ctx.to(dev, non_blocking=True))
                slots.append(ctx[s:])
        slots = torch.cat(slots).to(dev) if slots else None
        kda = torch.tensor([it.kda_pages for it in items], dtype=torch.long).view(len(items), -1).to(dev)
        mixer = PrefillMixer(self.pool, self.kda_slot, self.mla_slot, cu.to(dev), starts, lengths, slots, context, kda,
                             positions.to(dev)[None])
        embeds = (self.images.embed(self.lm.model.embed_tokens(ids), items, cu.tolist())
                  if any(it.images for it in items) else None)
        h = self.lm.model(ids, mixer=mixer, inputs_embeds=embeds)  # [1,T,D]
        last = torch.tensor([int(cu[i + 1]) - 1 for i, it in enumerate(items) if it.sample is not None],
                            dtype=torch.long, device=dev)
        return self.lm.lm_head(self.lm.model.norm(h[0, last])).float()

    def release(self, seq_id: str) -> None:
        """Forget what is kept for a finished sequence (the features of an image it did not finish prefilling)."""
        self.images.release(seq_id)

    def decode_logits(self, items: list[DecodeItem]) -> torch.Tensor:
        """The next-token logits [B,V] fp32 of one decode step (the pool's state advances by the items' tokens)."""
        if self.use_graphs:
            return self._replay(items)
        ints, _, table = self._host_inputs(items)
        ints = ints.to(self.device)
        return self._forward(ints[:, 0], ints[:, 5], ints[:, 1].to(torch.int32), table.to(self.device),
                             ints[:, N_INT:])

    def _host_inputs(self, items: list[DecodeItem]):
        """A decode step's inputs on the host, each built by one ``torch.tensor`` call (the host work of a step is
        on the critical path: ``benchmarks/bench_host.py``): ints [B, N_INT + kda_pages] long (token, position,
        top_k, seed, step, the row of the previous step's results holding the token (-1: the token is given), KDA
        pages), floats [B, 2] fp32 (temperature, top_p), page table [B, cols] int32 padded with the
        scratch page (cols: the most MLA pages of any row; [B, 1] without MLA layers)."""
        src = [self._prev_row[it.seq_id] if it.token == FROM_DEVICE else -1 for it in items]
        rows = [_row(it) for it in items]
        ints = torch.tensor([[it.token, it.position, r.top_k, r.seed, r.step, s, *it.kda_pages]
                             for it, r, s in zip(items, rows, src)], dtype=torch.long)
        floats = torch.tensor([[r.temperature, r.top_p] for r in rows], dtype=torch.float32)
        s = self.pool.scratch
        cols = max(max(len(it.mla_pages) for it in items), 1) if self.mla_slot else 1
        table = torch.tensor([it.mla_pages + [s] * (cols - len(it.mla_pages)) for it in items] if self.mla_slot
                             else [[s]] * len(items), dtype=torch.int32)
        return ints, floats, table

    def _decode_logits(self, ids, src, positions, page_table, kda_index) -> torch.Tensor:
        """ids [B], src [B] (>= 0: take the token from row src of the previous step's samples instead), positions
        [B] int32, page_table [B,P] int32, kda_index [B,kda_pages] long -> logits [B,V] fp32."""
        ids = torch.where(src >= 0, self._prev_tokens[src.clamp(min=0)], ids)
        mixer = DecodeMixer(self.key, self.kda_slot, self.mla_slot, self.pool.layout.records_per_page, positions,
                            page_table, kda_index)
        h = self.lm.model(ids[:, None], mixer=mixer)
        return self.lm.lm_head(self.lm.model.norm(h[:, 0])).float()

    # ---- warm-up ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def warmup(self, prefill_chunk: int, step_tokens: int, progress=None) -> None:
        """Run every shape the steps will need once, on the pool's scratch page only: prefill forwards (one chunk of
        16 tokens, of ``prefill_chunk`` and a packed step of ``step_tokens``: Triton autotunes per shape), then on
        CUDA with graphs the decode forward and the four sampler variants of every bucket (compilation and capture:
        what a first request would otherwise wait for); eagerly, a decode step at batch 1 and at the largest batch.
        Nothing may be running (the engine holds its lock)."""
        say = progress or (lambda text: None)
        L, s = self.pool.layout, self.pool.scratch
        kda = [s] * L.kda_pages
        warm = SamplingRow(1.0, 0, 1.0, 0, 0)
        cuda = self.device.type == "cuda"
        chunks = [[16]] + ([[prefill_chunk], [prefill_chunk] * max(1, step_tokens // prefill_chunk)] if cuda else [])
        for i, lengths in enumerate(chunks):
            say(f"prefill {sum(lengths)} tokens ({i + 1}/{len(chunks)})")
            items = [PrefillItem(f"warmup-{j}", [0] * n, 0, [s] * max(1, L.mla_pages(n)), kda, warm)
                     for j, n in enumerate(lengths)]
            self.launch(SchedulerOutput(prefill=items)).wait()
        if self.use_graphs:
            for i, bs in enumerate(self.sizes):
                say(f"capturing CUDA graphs: batch {bs} ({i + 1}/{len(self.sizes)})")
                self._graph_for(bs)
                for key in ((bs, f, t) for f in (False, True) for t in (False, True)):
                    if key not in self._sample_graphs:
                        self._sample_graphs[key] = self._capture(self._graph_sample, *key)
        else:
            for bs in sorted({1, max(self.sizes)}):
                say(f"decode batch {bs}")
                items = [DecodeItem(f"warmup-{j}", 0, 0, [s], kda, warm) for j in range(bs)]
                self.launch(SchedulerOutput(decode=items)).wait()
        self._prev_row = {}
        if cuda:
            torch.cuda.synchronize(self.device)

    # ---- sampling ---------------------------------------------------------------------------------------------
    def _sampling_tensors(self, items):
        dev = self.device
        rows = [_row(it) for it in items]
        f = torch.tensor([[r.temperature, r.top_p] for r in rows], dtype=torch.float32, device=dev)
        i = torch.tensor([[r.top_k, r.seed, r.step] for r in rows], dtype=torch.long, device=dev)
        return f[:, 0], i[:, 0], f[:, 1], i[:, 1], i[:, 2]

    def _sample_packed(self, logits, items) -> torch.Tensor:
        """Eager sampling (varying shapes) of ``items``' rows of ``logits`` -> packed results [n, 2 + 2K] fp32."""
        temp, top_k, top_p, seed, step = self._sampling_tensors(items)
        filtered, top = _sampling_kind(items)
        return _pack(*sample(logits, temp, top_k, top_p, seed, step, filtered, top))

    # ---- CUDA graphs ------------------------------------------------------------------------------------------
    def _static_buffers(self, n: int, kda_pages: int) -> None:
        dev, V = self.device, self.model.config.vocab_size
        # int64 inputs in one buffer (one copy per step): ids, positions, top_k, seed, step, source row, kda pages
        self._ints = torch.zeros(n, N_INT + kda_pages, dtype=torch.long, device=dev)
        self._floats = torch.zeros(n, 2, dtype=torch.float32, device=dev)  # temperature, top_p
        self._table = torch.full((n, self.max_pages), self.pool.scratch, dtype=torch.int32, device=dev)
        self._ints[:, N_INT:] = self.pool.scratch
        self._positions = torch.zeros(n, dtype=torch.int32, device=dev)
        self._logits = torch.zeros(n, V, dtype=torch.float32, device=dev)
        self._result = torch.zeros(n, 2 + 2 * TOP_LOGPROBS, dtype=torch.float32, device=dev)
        # pinned staging of the inputs, two of each: with asynchronous scheduling the host fills one while the
        # device may still be copying from the other (the step before, whose results it has not waited for)
        self._host = [torch.zeros(n, N_INT + kda_pages, dtype=torch.long).pin_memory() for _ in range(2)]
        self._host_f = [torch.zeros(n, 2, dtype=torch.float32).pin_memory() for _ in range(2)]
        self._input_flip = 0
        self._mempool = torch.cuda.graph_pool_handle()

    def _bucket(self, B: int) -> int:
        return next(s for s in self.sizes if s >= B)

    def _graph_forward(self, bs: int):
        self._positions[:bs].copy_(self._ints[:bs, 1])
        self._logits[:bs] = self._forward(self._ints[:bs, 0], self._ints[:bs, 5], self._positions[:bs],
                                          self._table[:bs], self._ints[:bs, N_INT:])

    def _graph_sample(self, bs: int, filtered: bool, top: bool):
        ints, floats = self._ints[:bs], self._floats[:bs]
        self._result[:bs] = _pack(*self._sample(self._logits[:bs], floats[:, 0], ints[:, 2], floats[:, 1],
                                                ints[:, 3], ints[:, 4], filtered, top))

    def _capture(self, fn, *args) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: compilation, Triton autotuning, allocator
                fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._mempool):
            fn(*args)
        return g

    def _graph_for(self, bs: int) -> torch.cuda.CUDAGraph:
        if bs not in self._graphs:
            self._reset_rows(0, bs)
            self._graphs[bs] = self._capture(self._graph_forward, bs)
        return self._graphs[bs]

    def _reset_rows(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) become padding: position 0 of the scratch page, the scratch page's KDA records."""
        self._ints[lo:hi] = 0
        self._ints[lo:hi, 5] = -1
        self._ints[lo:hi, N_INT:] = self.pool.scratch
        self._table[lo:hi, 0] = self.pool.scratch
        self._floats[lo:hi] = 0

    def _replay(self, items: list[DecodeItem]) -> torch.Tensor:
        """Copy the step's inputs into the static buffers (three copies), replay the bucket's forward graph."""
        B = len(items)
        bs = self._bucket(B)
        graph = self._graph_for(bs)
        ints, floats, table = self._host_inputs(items)
        self._input_flip ^= 1
        host, host_f = self._host[self._input_flip][:B], self._host_f[self._input_flip][:B]
        host.copy_(ints)
        host_f.copy_(floats)
        self._ints[:B].copy_(host, non_blocking=True)
        self._floats[:B].copy_(host_f, non_blocking=True)
        if bs > B:
            self._reset_rows(B, bs)
        if self.mla_slot:
            self._table[:B, : table.shape[1]].copy_(table, non_blocking=True)
        graph.replay()
        return self._logits[:B]

    def _sample_graphed(self, items: list[DecodeItem]) -> torch.Tensor:
        """Replay the sampler's graph over the logits buffer -> the packed results [B, 2 + 2K] (a static buffer)."""
        B = len(items)
        bs = self._bucket(B)
        key = (bs, *_sampling_kind(items))
        if key not in self._sample_graphs:
            self._sample_graphs[key] = self._capture(self._graph_sample, *key)
        self._sample_graphs[key].replay()
        return self._result[:B]
