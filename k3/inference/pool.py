"""One page pool for both kinds of per-request state (SPEC §7): one byte tensor [pages, page_bytes], one
allocator, one reference count per page, one LRU of cached pages nobody holds. See README.md in this folder.

Legend: L_mla / L_kda layer counts, R kv_lora_rank, Dr rope dim, H KDA heads, K head dim, W conv width.

A page is typed only by how it is viewed, and every view is a strided view of the one tensor, so kernels read
and write the pages in place (no gather of a request's context or state, ever, in decode):
  MLA page:  [page_tokens, L_mla, R + Dr] in the cache dtype: token t of the page, MLA layer j, its latent.
  KDA page:  ``records_per_page`` layer records, each one KDA layer's state of one request:
             recurrent state [H, K, K] fp32, then conv tails [3, H*K, W-1] in the cache dtype.
A request's KDA state for layer l lives in its KDA page l // records_per_page, record l % records_per_page:
``kda_state(l)`` is that record for every page as one strided tensor [pages, H, K, K], indexed by page id.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..config import K3Config

ALIGN = 256  # bytes: pages and records start on this boundary (vector loads, fp32 views)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class PageLayout:
    n_mla: int
    latent: int  # R + Dr
    n_kda: int
    kda_heads: int
    kda_dim: int
    conv_width: int
    page_tokens: int
    dtype: torch.dtype = torch.float32  # MLA latents and conv tails; recurrent states are always fp32

    @classmethod
    def from_config(cls, c: K3Config, page_tokens: int, dtype: torch.dtype = torch.float32) -> "PageLayout":
        return cls(len(c.full_attn_layers), c.kv_lora_rank + c.qk_rope_head_dim, len(c.kda_layers), c.kda_num_heads,
                   c.kda_head_dim, c.short_conv_kernel_size, page_tokens, dtype)

    def __post_init__(self):
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {self.page_tokens}")
        if self.n_kda and self.records_per_page < 1:
            need = math.ceil(self.record_bytes / max(self.mla_bytes_per_token, 1))
            raise ValueError(f"a page of {self.page_tokens} tokens ({self.page_bytes:,} bytes) cannot hold one KDA "
                             f"layer's state ({self.record_bytes:,} bytes): use page_tokens >= {need}")

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def mla_bytes_per_token(self) -> int:
        return self.n_mla * self.latent * self.itemsize

    @property
    def state_numel(self) -> int:
        """fp32 values of one KDA layer's recurrent state."""
        return self.kda_heads * self.kda_dim * self.kda_dim

    @property
    def conv_numel(self) -> int:
        """Values of one KDA layer's three conv tails."""
        return 3 * self.kda_heads * self.kda_dim * (self.conv_width - 1)

    @property
    def record_bytes(self) -> int:
        """One KDA layer's state of one request, padded to the alignment."""
        return _round_up(4 * self.state_numel + self.itemsize * self.conv_numel, ALIGN)

    @property
    def kda_state_bytes(self) -> int:
        """One request's KDA state, all layers (unpadded): constant in context length."""
        return self.n_kda * (4 * self.state_numel + self.itemsize * self.conv_numel)

    @property
    def page_bytes(self) -> int:
        raw = self.page_tokens * self.mla_bytes_per_token if self.n_mla else self.record_bytes
        return _round_up(max(raw, 1), ALIGN)

    @property
    def records_per_page(self) -> int:
        return self.page_bytes // self.record_bytes

    @property
    def kda_pages(self) -> int:
        return math.ceil(self.n_kda / self.records_per_page) if self.n_kda else 0

    def mla_pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_tokens) if self.n_mla else 0


class OutOfPages(RuntimeError):
    pass


class PagePool:
    """The device pages, their reference counts and the LRU of cached (prefix) pages nobody holds. Page
    ``scratch`` (the last) is never handed out: padded rows of a decode batch read and write it."""

    def __init__(self, layout: PageLayout, num_pages: int, device="cpu"):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (one is the scratch page), got {num_pages}")
        self.layout, self.num_pages = layout, num_pages
        self.data = torch.zeros(num_pages, layout.page_bytes, dtype=torch.uint8, device=device)
        self.scratch = num_pages - 1
        self.refs = [0] * num_pages
        self.free: list[int] = list(range(num_pages - 2, -1, -1))
        self.cached: set[int] = set()  # pages the prefix cache points into
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached pages with no holder, oldest first
        self.on_evict = None  # callback(page), before the page is reused: the prefix cache forgets (or saves) it

    @property
    def usable(self) -> int:
        return self.num_pages - 1

    # ---- allocation and reference counts ----------------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        if n > len(self.free) + len(self.lru):
            raise OutOfPages(f"need {n} pages, {len(self.free)} free and {len(self.lru)} evictable of {self.usable}")
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
        if self.on_evict is not None:
            self.on_evict(page)
        self.free.append(page)

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
        """The prefix cache dropped these pages: free them if nobody holds them."""
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

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        if src:
            self.data[self._index(dst)] = self.data[self._index(src)]

    def _index(self, pages) -> torch.Tensor:
        return torch.as_tensor(pages, dtype=torch.long, device=self.data.device)

    # ---- typed views (strided, in place) -------------------------------------------------------------------
    def mla_view(self) -> torch.Tensor:
        """[pages, page_tokens, L_mla, R + Dr] in the cache dtype."""
        L = self.layout
        n = L.page_tokens * L.mla_bytes_per_token
        return self.data[:, :n].view(L.dtype).view(self.num_pages, L.page_tokens, L.n_mla, L.latent)

    def _record(self, layer: int, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
        L = self.layout
        size = torch.empty((), dtype=dtype).element_size()
        base = (layer % L.records_per_page) * L.record_bytes + offset
        flat = self.data.view(-1).view(dtype)
        inner = list(torch.empty(shape).stride())
        return flat.as_strided((self.num_pages, *shape), (L.page_bytes // size, *inner), base // size)

    def kda_state(self, layer: int) -> torch.Tensor:
        """KDA layer ``layer``'s recurrent state of every page's record slot: [pages, H, K, K] fp32 (strided).
        Index it with a request's page ``kda_pages[layer // records_per_page]``."""
        L = self.layout
        return self._record(layer, 0, torch.float32, (L.kda_heads, L.kda_dim, L.kda_dim))

    def kda_conv(self, layer: int) -> torch.Tensor:
        """KDA layer ``layer``'s three conv tails of every page's record slot: [pages, 3, H*K, W-1] (strided)."""
        L = self.layout
        return self._record(layer, 4 * L.state_numel, L.dtype, (3, L.kda_heads * L.kda_dim, L.conv_width - 1))

    def zero_kda(self, pages: list[int]) -> None:
        """A new request's KDA state: zero recurrent states and conv tails (its pages hold nothing else)."""
        if pages:
            self.data[self._index(pages)] = 0


class HostPool:
    """The write-back tier (SPEC §7): pages of prefix cache evicted from the device, in (pinned) CPU memory, with
    their own LRU. A page moves here only when the device needs its room, and back on a prefix hit."""

    def __init__(self, page_bytes: int, num_pages: int, pin: bool = False):
        self.num_pages = num_pages
        self.data = torch.empty(num_pages, page_bytes, dtype=torch.uint8, pin_memory=pin)
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        self.lru: OrderedDict[int, None] = OrderedDict()  # every used host page, oldest first
        self.on_evict = None  # callback(host_page): the prefix cache forgets what lived there

    def store(self, device_data: torch.Tensor, page: int) -> int | None:
        """Copy device page ``page`` here; returns the host page (None when the tier has no pages)."""
        if not self.num_pages:
            return None
        if not self.free:
            old, _ = self.lru.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(old)
            self.free.append(old)
        hp = self.free.pop()
        self.data[hp].copy_(device_data[page])
        self.lru[hp] = None
        return hp

    def load(self, hp: int, device_data: torch.Tensor, page: int) -> None:
        device_data[page].copy_(self.data[hp], non_blocking=True)
        self.lru.move_to_end(hp)

    def release(self, hp: int) -> None:
        if self.lru.pop(hp, "absent") is None:
            self.free.append(hp)

    @property
    def pages_in_use(self) -> int:
        return len(self.lru)
