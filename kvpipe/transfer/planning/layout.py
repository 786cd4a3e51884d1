"""One rank's KV pool as the transfer layer sees it: raw buffers plus the shape that gives them meaning.

Each buffer is one (layer, K/V) tensor of shape [num_pages, kv_heads, page_size, head_dim]
(kvpipe/cache/kv_pool.py). Byte offsets inside a buffer:
  page p, local head h  ->  p * page_nbytes + h * head_nbytes
so one page is contiguous and so is any head range [h0, h1) of one page.

An MLA model's layout is "latent, replicated": one buffer per layer (buffers_per_layer 1),
one head (total_kv_heads 1) that every TP rank holds whole, so heterogeneous TP never slices it
and tp_mapping gives each decode rank exactly one source rank.

Sliding-window layers (GPT-OSS): `swa_layers` are the layout's layer indices whose pages come
from a request's window page table (only the pages covering the window are held), not from its
full page table. Both tables take ids from one page allocator and the pool may alias buffers:
a sliding layer's K (V) can be the very tensor of a full layer's, kept apart by disjoint page
ids. So `buffer_addrs` may repeat an address; `unique_buffers` lists each region once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the pool pulls in torch; the layout itself is plain data
    from kvpipe.cache.kv_pool import KVPool


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    page_size: int  # tokens per page
    kv_heads: int  # heads held by this rank
    head_start: int  # global index of this rank's first KV head
    total_kv_heads: int  # KV heads of the model (before TP)
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    itemsize: int  # bytes per element
    buffer_addrs: tuple[int, ...]  # num_buffers base addresses: layer-major, K then V (or the latent)
    buffer_nbytes: int  # bytes of each buffer (all buffers have the same shape)
    buffers_per_layer: int = 2  # K and V; 1: the MLA latent
    swa_layers: tuple[int, ...] = ()  # increasing layer indices paged by the window page table

    def __post_init__(self) -> None:
        if self.buffers_per_layer not in (1, 2):
            raise ValueError(f"buffers_per_layer must be 1 (latent) or 2 (K and V), got {self.buffers_per_layer}")
        if self.latent and self.total_kv_heads != 1:
            raise ValueError(f"a latent layout has one replicated head, not {self.total_kv_heads}")
        if len(self.buffer_addrs) != self.num_buffers:
            raise ValueError(f"expected {self.num_buffers} buffer addresses, got {len(self.buffer_addrs)}")
        for name in ("num_layers", "page_size", "kv_heads", "total_kv_heads", "head_dim", "itemsize"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_start < 0 or self.head_end > self.total_kv_heads:
            raise ValueError(f"heads [{self.head_start}, {self.head_end}) outside [0, {self.total_kv_heads})")
        if self.buffer_nbytes % self.page_nbytes:
            raise ValueError(
                f"buffer of {self.buffer_nbytes} bytes is not a whole number of {self.page_nbytes}-byte pages"
            )
        swa = self.swa_layers
        if any(not 0 <= i < self.num_layers for i in swa) or any(a >= b for a, b in zip(swa, swa[1:])):
            raise ValueError(f"sliding-window layers {swa} must increase inside [0, {self.num_layers})")

    @property
    def head_end(self) -> int:
        return self.head_start + self.kv_heads

    @property
    def head_nbytes(self) -> int:
        """Bytes of one head of one page: page_size * head_dim * itemsize."""
        return self.page_size * self.head_dim * self.itemsize

    @property
    def page_nbytes(self) -> int:
        return self.kv_heads * self.head_nbytes

    @property
    def num_pages(self) -> int:
        return self.buffer_nbytes // self.page_nbytes

    @property
    def latent(self) -> bool:
        """One MLA latent buffer per layer instead of K and V."""
        return self.buffers_per_layer == 1

    @property
    def num_buffers(self) -> int:
        return self.buffers_per_layer * self.num_layers

    @property
    def token_nbytes(self) -> int:
        """KV bytes of one token over all layers, K and V (or latent), local heads."""
        return self.buffers_per_layer * self.num_layers * self.kv_heads * self.head_dim * self.itemsize

    @property
    def swa_mask(self) -> tuple[bool, ...]:
        """[num_layers]: the layer's pages come from the window page table."""
        swa = set(self.swa_layers)
        return tuple(i in swa for i in range(self.num_layers))

    @property
    def aliased(self) -> bool:
        """Some buffers share one address (sliding and full layers over one tensor)."""
        return len(set(self.buffer_addrs)) < len(self.buffer_addrs)

    def unique_buffers(self) -> tuple[list[int], list[int]]:
        """(addresses, sizes) of the distinct buffers, first occurrence order: what to register
        with a backend (Mooncake refuses or double counts a region registered twice) and what
        to sum for the pool's bytes."""
        addrs = list(dict.fromkeys(self.buffer_addrs))
        return addrs, [self.buffer_nbytes] * len(addrs)

    @classmethod
    def from_pool(cls, pool: KVPool, head_start: int = 0, total_kv_heads: int | None = None) -> KVLayout:
        infos = pool.buffer_infos()
        nbytes = {b.nbytes for b in infos}
        if len(nbytes) != 1:
            raise ValueError(f"KV buffers differ in size: {sorted(nbytes)}")
        return cls(
            num_layers=pool.num_layers,
            page_size=pool.page_size,
            kv_heads=pool.kv_heads,
            head_start=head_start,
            total_kv_heads=pool.kv_heads if total_kv_heads is None else total_kv_heads,
            head_dim=pool.head_dim,
            dtype=str(pool.dtype).removeprefix("torch."),
            itemsize=infos[0].nbytes // (pool.num_pages * pool.kv_heads * pool.page_size * pool.head_dim),
            buffer_addrs=tuple(b.addr for b in infos),
            buffer_nbytes=nbytes.pop(),
            buffers_per_layer=pool.buffers_per_layer,
            swa_layers=tuple(int(i) for i in getattr(pool, "swa_layers", ())),
        )

    def compatible_with(self, other: KVLayout) -> str | None:
        """None when KV can move between the two pools, else why not (for a clear error)."""
        checks = (
            ("KV kind (1: MLA latent, 2: K and V)", self.buffers_per_layer, other.buffers_per_layer),
            ("page size", self.page_size, other.page_size),
            ("KV dtype", self.dtype, other.dtype),
            ("number of layers", self.num_layers, other.num_layers),
            ("head_dim", self.head_dim, other.head_dim),
            ("total KV heads", self.total_kv_heads, other.total_kv_heads),
            ("itemsize", self.itemsize, other.itemsize),
            ("sliding-window layers", self.swa_layers, other.swa_layers),
        )
        for what, mine, theirs in checks:
            if mine != theirs:
                return f"{what} mismatch: {mine!r} here vs {theirs!r} on the peer"
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (bootstrap): tuples as lists, so a round trip through JSON compares equal."""
        return {
            f: list(v) if isinstance(v, tuple) else v
            for f, v in ((f, getattr(self, f)) for f in self.__dataclass_fields__)
        }
