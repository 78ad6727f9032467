"""One paged block pool for both cache kinds (SPEC §7): one byte tensor [pages, page_bytes], one allocator,
one reference count per page, one LRU of cached pages nobody holds. See README.md in this folder.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .layout import CacheLayout


class OutOfPages(RuntimeError):
    pass


class BlockPool:
    def __init__(self, layout: CacheLayout, num_pages: int, device="cpu"):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.layout, self.num_pages = layout, num_pages
        self.data = torch.zeros(num_pages, layout.page_bytes, dtype=torch.uint8, device=device)
        self.refs = [0] * num_pages
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        self.cached: set[int] = set()  # pages registered in the prefix cache
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached pages with no holder, oldest first
        self.on_evict = None  # callback(page) -> None: the prefix cache forgets what lived there

    # ---- allocation and reference counts ----------------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        if n > len(self.free) + len(self.lru):
            raise OutOfPages(f"need {n} pages, {len(self.free)} free and {len(self.lru)} evictable of {self.num_pages}")
        out = []
        for _ in range(n):
            if not self.free:
                self.evict_one()
            p = self.free.pop()
            self.refs[p] = 1
            out.append(p)
        return out

    def evict_one(self) -> None:
        page, _ = self.lru.popitem(last=False)
        self.cached.discard(page)
        self.free.append(page)
        if self.on_evict is not None:
            self.on_evict(page)

    def incref(self, pages) -> None:
        for p in pages:
            if self.refs[p] == 0:
                self.lru.pop(p, None)
            self.refs[p] += 1

    def decref(self, pages) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"page {p} released more often than it was held")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self.cached:
                    self.lru[p] = None  # keep its contents for prefix hits until memory is needed
                else:
                    self.free.append(p)

    def mark_cached(self, pages) -> None:
        for p in pages:
            self.cached.add(p)
            if self.refs[p] == 0:
                self.lru[p] = None

    def uncache(self, pages) -> None:
        """The prefix cache dropped these pages (e.g. a partly evicted checkpoint): free them if unheld."""
        for p in pages:
            if p in self.cached:
                self.cached.discard(p)
                if self.lru.pop(p, "absent") is None:
                    self.free.append(p)

    def touch(self, pages) -> None:
        for p in pages:
            if p in self.lru:
                self.lru.move_to_end(p)

    @property
    def pages_in_use(self) -> int:
        return sum(1 for r in self.refs if r > 0)

    @property
    def available(self) -> int:
        return len(self.free) + len(self.lru)

    # ---- typed access -------------------------------------------------------------------------------------
    def _mla_view(self, pages) -> torch.Tensor:
        L = self.layout
        raw = self.data[torch.as_tensor(pages, dtype=torch.long, device=self.data.device)]  # [P, page_bytes] copy
        return raw.view(L.dtype).view(len(pages) * L.page_tokens, L.n_mla, L.latent)

    def read_mla(self, pages, length: int) -> torch.Tensor:
        """[length, n_mla, R + Dr] latents of the first ``length`` tokens held in ``pages``."""
        if length == 0:
            L = self.layout
            return torch.zeros(0, L.n_mla, L.latent, dtype=L.dtype, device=self.data.device)
        return self._mla_view(pages[: self.layout.mla_pages(length)])[:length]

    def write_mla(self, pages, start: int, x: torch.Tensor) -> None:
        """Write x [T, n_mla, R + Dr] for token positions [start, start + T) of the page list."""
        L = self.layout
        x = x.to(L.dtype).contiguous()
        t = 0
        while t < x.shape[0]:
            pos = start + t
            page, off = pages[pos // L.page_tokens], pos % L.page_tokens
            n = min(L.page_tokens - off, x.shape[0] - t)
            view = self.data[page].view(L.dtype).view(L.page_tokens, L.n_mla, L.latent)
            view[off: off + n] = x[t: t + n]
            t += n

    # ---- batched access: one gather / one scatter for a whole decode batch -----------------------------------
    def _index(self, pages) -> torch.Tensor:
        return torch.as_tensor(pages, dtype=torch.long, device=self.data.device)

    def read_mla_batch(self, page_lists, lengths, S: int) -> torch.Tensor:
        """[B, S, n_mla, R + Dr]: row b holds the latents of the first lengths[b] tokens of page_lists[b], zeros
        after them (one gather; what lies in a page past a sequence's length never reaches the result)."""
        L, B = self.layout, len(page_lists)
        if S == 0:
            return torch.zeros(B, 0, L.n_mla, L.latent, dtype=L.dtype, device=self.data.device)
        P = L.mla_pages(S)
        idx = [list(pages[:P]) + [0] * (P - len(pages[:P])) for pages in page_lists]  # page 0 pads: masked below
        raw = self.data[self._index(idx).view(-1)].view(L.dtype).view(B, P * L.page_tokens, L.n_mla, L.latent)[:, :S]
        keep = torch.arange(S, device=self.data.device)[None, :] < self._index(lengths)[:, None]  # [B,S]
        return torch.where(keep[:, :, None, None], raw, raw.new_zeros(()))

    def write_mla_tokens(self, page_lists, positions, x: torch.Tensor) -> None:
        """Write x [B, n_mla, R + Dr], row b at token position positions[b] of page_lists[b] (one scatter)."""
        L = self.layout
        row, per_page = L.n_mla * L.latent, L.page_bytes // L.itemsize
        base = [pages[pos // L.page_tokens] * per_page + (pos % L.page_tokens) * row
                for pages, pos in zip(page_lists, positions)]
        idx = self._index(base)[:, None] + torch.arange(row, device=self.data.device)  # [B, row] element offsets
        flat = self.data.view(-1).view(L.dtype)
        flat[idx.view(-1)] = x.to(device=flat.device, dtype=L.dtype).reshape(-1)

    def read_kda_batch(self, page_lists) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (states [n_kda, B, H, K, K] fp32, conv [n_kda, 3, B, H*K, W-1]) of B requests (one gather)."""
        L, B = self.layout, len(page_lists)
        raw = self.data[self._index(page_lists).view(-1)].view(B, -1)  # [B, kda_pages * page_bytes]
        sb, cb = 4 * L.n_kda * L.state_numel, L.itemsize * L.n_kda * L.conv_numel
        states = raw[:, :sb].contiguous().view(torch.float32).view(B, L.n_kda, L.kda_heads, L.kda_dim, L.kda_dim)
        conv = raw[:, sb: sb + cb].contiguous().view(L.dtype).view(B, L.n_kda, 3, L.kda_heads * L.kda_dim,
                                                                    L.conv_width - 1)
        return states.transpose(0, 1), conv.permute(1, 2, 0, 3, 4)

    def write_kda_batch(self, page_lists, states: torch.Tensor, conv: torch.Tensor) -> None:
        """states [n_kda, B, H, K, K], conv [n_kda, 3, B, H*K, W-1] -> the B requests' pages (one scatter)."""
        L, B = self.layout, len(page_lists)
        dev = self.data.device
        st = states.to(device=dev, dtype=torch.float32).transpose(0, 1).contiguous().view(B, -1).view(torch.uint8)
        cv = conv.to(device=dev, dtype=L.dtype).permute(2, 0, 1, 3, 4).contiguous().view(B, -1).view(torch.uint8)
        width = L.kda_pages * L.page_bytes
        blob = torch.cat([st, cv, st.new_zeros(B, width - st.shape[1] - cv.shape[1])], dim=1)
        self.data[self._index(page_lists).view(-1)] = blob.view(B * L.kda_pages, L.page_bytes)

    def copy_page(self, src: int, dst: int) -> None:
        self.data[dst] = self.data[src]

    def read_kda(self, pages) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (states [n_kda, H, K, K] fp32, conv [n_kda, 3, H*K, W-1])."""
        L = self.layout
        flat = self.data[torch.as_tensor(pages, dtype=torch.long, device=self.data.device)].reshape(-1)
        sb = 4 * L.n_kda * L.state_numel
        states = flat[:sb].view(torch.float32).view(L.n_kda, L.kda_heads, L.kda_dim, L.kda_dim)
        cb = L.itemsize * L.n_kda * L.conv_numel
        conv = flat[sb: sb + cb].view(L.dtype).view(L.n_kda, 3, L.kda_heads * L.kda_dim, L.conv_width - 1)
        return states, conv

    def write_kda(self, pages, states: torch.Tensor, conv: torch.Tensor) -> None:
        L = self.layout
        blob = torch.cat([states.to(torch.float32).contiguous().view(-1).view(torch.uint8),
                          conv.to(L.dtype).contiguous().view(-1).view(torch.uint8)])
        pad = len(pages) * L.page_bytes - blob.numel()
        blob = torch.cat([blob, blob.new_zeros(pad)]).view(len(pages), L.page_bytes).to(self.data.device)
        self.data[torch.as_tensor(pages, dtype=torch.long, device=self.data.device)] = blob
