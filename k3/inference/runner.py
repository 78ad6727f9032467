"""The model runner (SPEC §7): device buffers, the forward of a scheduler plan, sampling; the only part of the
engine that touches the device. CUDA graphs are captured here and nowhere else.

Legend: N prefill sequences, T packed prefill tokens, B decode rows, Bb the CUDA-graph bucket B is padded to,
P max pages per sequence, V vocabulary, K reported alternatives.

- Prefill: the plan's chunks of N sequences run as one packed row (``PrefillMixer``); logits only at the last
  token of sequences whose prompt is complete.
- Decode: one token per row (``DecodeMixer``: state and latents read and written in place). On CUDA with a
  bf16/fp16 model the forward and the sampler are captured as CUDA graphs per batch-size bucket (1, 2, 4, ...,
  256) over static buffers; a step copies its inputs into those buffers (three host-to-device copies), replays
  two graphs and brings the sampled tokens back in one device-to-host copy. With ``compile`` the forward is
  ``torch.compile``d first (the custom decode kernels stay opaque). Padded rows of a bucket read and write the
  pool's scratch page only.
"""

from __future__ import annotations

import torch

from ..ops.grouped_mm import fused_dtypes
from .mixers import DecodeMixer, PrefillMixer, register_pool, release_pool
from .pool import PagePool
from .sampler import TOP_LOGPROBS, sample
from .scheduler import DecodeItem, PrefillItem, Sampled, SchedulerOutput

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _pack(tokens, lp, top_lp, top_id) -> torch.Tensor:
    """[B, 2 + 2K] fp32: token id, its logprob, K alternatives' logprobs and ids (ids < 2^24: exact in fp32)."""
    return torch.cat([tokens[:, None].float(), lp[:, None], top_lp, top_id.float()], dim=1)


def _unpack(packed: torch.Tensor, ids: list[str], wants: list[int]) -> dict[str, Sampled]:
    K = (packed.shape[1] - 2) // 2
    rows = packed.tolist()
    out = {}
    for sid, row, want in zip(ids, rows, wants):
        top = tuple((int(row[2 + K + j]), float(row[2 + j])) for j in range(min(want, K)))
        out[sid] = Sampled(int(row[0]), float(row[1]), top)
    return out


class ModelRunner:
    def __init__(self, model, pool: PagePool, max_context: int, max_batch: int, cuda_graphs: bool | None = None,
                 compile: bool | None = None, graph_sizes=GRAPH_SIZES):
        self.model, self.pool = model, pool
        self.key = register_pool(pool)
        mc = model.config
        kinds = [mc.layer_kind(i) for i in range(mc.num_hidden_layers)]
        self.kda_slot = {i: s for s, i in enumerate(i for i, k in enumerate(kinds) if k == "kda")}
        self.mla_slot = {i: s for s, i in enumerate(i for i, k in enumerate(kinds) if k == "mla")}
        self.device = pool.data.device
        L = pool.layout
        self.max_pages = max(1, L.mla_pages(max_context + 1))
        dtype = next(model.parameters()).dtype
        capable = self.device.type == "cuda" and dtype in fused_dtypes()
        if cuda_graphs and not capable:
            raise ValueError(f"CUDA graphs need a CUDA device and a {' or '.join(map(str, fused_dtypes()))} model "
                             f"(the experts' grouped matmul must not wait for the host); got {self.device} and "
                             f"{dtype}: pass cuda_graphs=False or load the model in bf16")
        self.use_graphs = capable if cuda_graphs is None else cuda_graphs
        self.compile = self.use_graphs if compile is None else compile
        self.sizes = sorted({s for s in graph_sizes if s < max_batch} | {max_batch})
        self._forward, self._sample = self._decode_logits, sample
        if self.compile:
            self._forward = torch.compile(self._decode_logits, dynamic=True)
            self._sample = torch.compile(sample, dynamic=True)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._sample_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        if self.use_graphs:
            self._static_buffers(max(self.sizes), L.kda_pages)

    def close(self) -> None:
        release_pool(self.key)

    # ---- the plan ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, plan: SchedulerOutput) -> dict[str, Sampled]:
        out: dict[str, Sampled] = {}
        if plan.prefill:
            out.update(self.prefill(plan.prefill))
        if plan.decode:
            out.update(self.decode(plan.decode))
        return out

    def prefill(self, items: list[PrefillItem]) -> dict[str, Sampled]:
        want = [it for it in items if it.sample is not None]
        logits = self.prefill_logits(items)
        return self._sample_eager(logits, want) if want else {}

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
        h = self.model.model(ids, mixer=mixer)  # [1,T,D]
        last = torch.tensor([int(cu[i + 1]) - 1 for i, it in enumerate(items) if it.sample is not None],
                            dtype=torch.long, device=dev)
        return self.model.lm_head(self.model.model.norm(h[0, last])).float()

    def decode(self, items: list[DecodeItem]) -> dict[str, Sampled]:
        logits = self.decode_logits(items)
        if self.use_graphs:
            return self._sample_graphed(items)
        return self._sample_eager(logits, items)

    def decode_logits(self, items: list[DecodeItem]) -> torch.Tensor:
        """The next-token logits [B,V] fp32 of one decode step (the pool's state advances by the items' tokens)."""
        if self.use_graphs:
            return self._replay(items)
        dev = self.device
        B = len(items)
        cols = max(len(it.mla_pages) for it in items) if self.mla_slot else 1
        table = torch.zeros(B, max(cols, 1), dtype=torch.int32)
        for b, it in enumerate(items):
            table[b, : len(it.mla_pages)] = torch.tensor(it.mla_pages, dtype=torch.int32)
        kda_index = torch.tensor([it.kda_pages for it in items], dtype=torch.long).view(B, -1)
        return self._forward(torch.tensor([it.token for it in items], device=dev),
                             torch.tensor([it.position for it in items], device=dev, dtype=torch.int32),
                             table.to(dev), kda_index.to(dev))

    def _decode_logits(self, ids, positions, page_table, kda_index) -> torch.Tensor:
        """ids [B], positions [B] int32, page_table [B,P] int32, kda_index [B,kda_pages] long -> logits [B,V] fp32."""
        mixer = DecodeMixer(self.key, self.kda_slot, self.mla_slot, self.pool.layout.records_per_page, positions,
                            page_table, kda_index)
        h = self.model.model(ids[:, None], mixer=mixer)
        return self.model.lm_head(self.model.model.norm(h[:, 0])).float()

    # ---- sampling ---------------------------------------------------------------------------------------------
    def _sampling_tensors(self, items):
        dev = self.device
        rows = [it.sample for it in items]
        f = torch.tensor([[r.temperature, r.top_p] for r in rows], dtype=torch.float32, device=dev)
        i = torch.tensor([[r.top_k, r.seed, r.step] for r in rows], dtype=torch.long, device=dev)
        return f[:, 0], i[:, 0], f[:, 1], i[:, 1], i[:, 2]

    def _sample_eager(self, logits, items) -> dict[str, Sampled]:
        temp, top_k, top_p, seed, step = self._sampling_tensors(items)
        filtered = any(it.sample.top_k > 0 or it.sample.top_p < 1.0 for it in items)
        packed = _pack(*sample(logits, temp, top_k, top_p, seed, step, filtered)).cpu()  # varying shapes: eager
        return _unpack(packed, [it.seq_id for it in items], [it.sample.logprobs for it in items])

    # ---- CUDA graphs ------------------------------------------------------------------------------------------
    def _static_buffers(self, n: int, kda_pages: int) -> None:
        dev, V = self.device, self.model.config.vocab_size
        # int64 inputs in one buffer (one copy per step): ids, positions, top_k, seed, step, kda pages
        self._ints = torch.zeros(n, 5 + kda_pages, dtype=torch.long, device=dev)
        self._floats = torch.zeros(n, 2, dtype=torch.float32, device=dev)  # temperature, top_p
        self._table = torch.full((n, self.max_pages), self.pool.scratch, dtype=torch.int32, device=dev)
        self._ints[:, 5:] = self.pool.scratch
        self._positions = torch.zeros(n, dtype=torch.int32, device=dev)
        self._logits = torch.zeros(n, V, dtype=torch.float32, device=dev)
        self._result = torch.zeros(n, 2 + 2 * TOP_LOGPROBS, dtype=torch.float32, device=dev)
        self._host = torch.zeros(n, 5 + kda_pages, dtype=torch.long).pin_memory()
        self._host_f = torch.zeros(n, 2, dtype=torch.float32).pin_memory()
        self._mempool = torch.cuda.graph_pool_handle()

    def _bucket(self, B: int) -> int:
        return next(s for s in self.sizes if s >= B)

    def _graph_forward(self, bs: int):
        self._positions[:bs].copy_(self._ints[:bs, 1])
        self._logits[:bs] = self._forward(self._ints[:bs, 0], self._positions[:bs], self._table[:bs],
                                          self._ints[:bs, 5:])

    def _graph_sample(self, bs: int, filtered: bool):
        ints, floats = self._ints[:bs], self._floats[:bs]
        self._result[:bs] = _pack(*self._sample(self._logits[:bs], floats[:, 0], ints[:, 2], floats[:, 1],
                                                ints[:, 3], ints[:, 4], filtered))

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

    def capture_all(self) -> None:
        """Capture every bucket now (largest first, sharing one memory pool) instead of on first use."""
        for bs in sorted(self.sizes, reverse=True):
            self._graph_for(bs)

    def _graph_for(self, bs: int) -> torch.cuda.CUDAGraph:
        if bs not in self._graphs:
            self._reset_rows(0, bs)
            self._graphs[bs] = self._capture(self._graph_forward, bs)
        return self._graphs[bs]

    def _reset_rows(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) become padding: position 0 of the scratch page, the scratch page's KDA records."""
        self._ints[lo:hi] = 0
        self._ints[lo:hi, 5:] = self.pool.scratch
        self._table[lo:hi, 0] = self.pool.scratch
        self._floats[lo:hi] = 0

    def _replay(self, items: list[DecodeItem]) -> torch.Tensor:
        """Copy the step's inputs into the static buffers (three copies), replay the bucket's forward graph."""
        B = len(items)
        bs = self._bucket(B)
        graph = self._graph_for(bs)
        host, host_f = self._host, self._host_f
        host[:B] = torch.tensor([[it.token, it.position, it.sample.top_k, it.sample.seed, it.sample.step, *it.kda_pages]
                                 for it in items], dtype=torch.long)
        host_f[:B] = torch.tensor([[it.sample.temperature, it.sample.top_p] for it in items], dtype=torch.float32)
        self._ints[:B].copy_(host[:B], non_blocking=True)
        self._floats[:B].copy_(host_f[:B], non_blocking=True)
        if bs > B:
            self._reset_rows(B, bs)
        if self.mla_slot:
            cols = max(len(it.mla_pages) for it in items)
            t = torch.full((B, cols), self.pool.scratch, dtype=torch.int32)
            for b, it in enumerate(items):
                t[b, : len(it.mla_pages)] = torch.tensor(it.mla_pages, dtype=torch.int32)
            self._table[:B, :cols].copy_(t, non_blocking=True)
        graph.replay()
        return self._logits[:B]

    def _sample_graphed(self, items: list[DecodeItem]) -> dict[str, Sampled]:
        """Replay the sampler's graph over the logits buffer; one device-to-host copy of the results."""
        B = len(items)
        bs = self._bucket(B)
        filtered = any(it.sample.top_k > 0 or it.sample.top_p < 1.0 for it in items)
        key = (bs, filtered)
        if key not in self._sample_graphs:
            self._sample_graphs[key] = self._capture(self._graph_sample, bs, filtered)
        self._sample_graphs[key].replay()
        return _unpack(self._result[:B].cpu(), [it.seq_id for it in items], [it.sample.logprobs for it in items])
