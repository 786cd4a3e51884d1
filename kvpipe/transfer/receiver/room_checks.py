"""What a decode checks of a room before it asks for its KV: its page lists per decode rank, its
window page tables, its draft pages and its state slot, against this decode's registered layouts
(ReceiverBook's engine side; plain numpy, reads only the layouts)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpipe.transfer.control.messages import DecodeRank
from kvpipe.transfer.planning.window_table import window_pages_problem


def per_rank_arrays(lists: Sequence[np.ndarray] | np.ndarray | list[int]) -> tuple[np.ndarray, ...]:
    """Page lists as one int64 array per decode rank; one flat list (an array or ints) is a
    single rank's."""
    if (
        isinstance(lists, np.ndarray)
        and lists.ndim == 1
        or (isinstance(lists, list) and all(isinstance(p, (int, np.integer)) for p in lists))
    ):
        return (np.asarray(lists, dtype=np.int64).ravel(),)
    return tuple(np.asarray(p, dtype=np.int64).ravel() for p in lists)


class RoomChecks:
    """add_room's argument checks over `ranks` (one per decode TP rank); ValueError names the room."""

    ranks: tuple[DecodeRank, ...]
    tp_size: int

    def check_pages(
        self, room: int, dst_pages: Sequence[np.ndarray] | np.ndarray | list[int], prefix_len: int
    ) -> tuple[np.ndarray, ...]:
        """add_room's page lists as one int64 array per decode rank, or ValueError (reads only the layouts)."""
        pages = per_rank_arrays(dst_pages)
        if len(pages) != self.tp_size:
            raise ValueError(f"room {room}: {len(pages)} page lists for {self.tp_size} decode ranks")
        ps = self.ranks[0].layout.page_size
        if prefix_len < 0 or prefix_len % ps:
            raise ValueError(f"room {room}: prefix_len {prefix_len} is not a multiple of the page size {ps}")
        for r, p in enumerate(pages):
            n = self.ranks[r].layout.num_pages
            if p.size and (p.min() < 0 or p.max() >= n or np.unique(p).size != p.size):
                raise ValueError(f"room {room}: decode rank {r} pages must be distinct ids in [0, {n})")
        return pages

    def check_swa_pages(
        self,
        room: int,
        swa_pages: Sequence[np.ndarray] | np.ndarray | list[int] | None,
        pages: tuple[np.ndarray, ...],
        prefix_len: int = 0,
    ) -> tuple[np.ndarray, ...] | None:
        """add_room's window page tables (per decode rank, aligned with `pages` from check_pages at
        their end, up to prefix_len // page_size entries more before them for logical pages below
        the prefix; -1 where no sliding-window page is wanted) as int64 arrays, or ValueError.
        Required iff the layout has sliding-window layers."""
        lay = self.ranks[0].layout
        if swa_pages is None:
            if lay.swa_layers:
                raise ValueError(f"room {room}: a sliding-window model's room needs its window pages (swa_pages)")
            return None
        if not lay.swa_layers:
            raise ValueError(f"room {room}: window pages (swa_pages) for a model without sliding-window layers")
        swa = per_rank_arrays(swa_pages)
        if len(swa) != self.tp_size:
            raise ValueError(f"room {room}: {len(swa)} window page lists for {self.tp_size} decode ranks")
        for r, (w, p) in enumerate(zip(swa, pages)):
            lay = self.ranks[r].layout
            lead = prefix_len // lay.page_size
            why = window_pages_problem(w, lay.num_pages, p, exact=True, aliased=lay.aliased, max_lead=lead)
            if why is not None:
                raise ValueError(f"room {room}: decode rank {r}: {why}")
        return swa

    def check_draft_pages(self, room: int, draft_pages: np.ndarray | list[int] | None) -> np.ndarray | None:
        """add_room's draft-pool pages as int64, or ValueError: rank 0 has a draft pool, and every
        rank with one has one of its size (STANDALONE: every rank its shard of the draft's heads;
        NEXTN: rank 0 alone the MTP layer's whole; the same page ids on every rank that holds one:
        one list for all, asked of those ranks only)."""
        if draft_pages is None:
            return None
        draft = self.ranks[0].draft
        if draft is None or any(r.draft is not None and r.draft.num_pages != draft.num_pages for r in self.ranks):
            raise ValueError(
                f"room {room}: draft pages need a draft-model KV pool on decode rank 0, "
                "of one size on every rank that has one"
            )
        pages = np.asarray(draft_pages, dtype=np.int64).ravel()
        if pages.size and (pages.min() < 0 or pages.max() >= draft.num_pages or np.unique(pages).size != pages.size):
            raise ValueError(f"room {room}: draft pages must be distinct ids in [0, {draft.num_pages})")
        return pages

    def check_state_slot(self, room: int, state_slot: int | None) -> None:
        """ValueError unless a hybrid decode (its ranks have state pools) names a slot inside them."""
        state = self.ranks[0].state
        if state is None:
            if state_slot is not None:
                raise ValueError(f"room {room}: a state slot for a model without recurrent state")
        elif state_slot is None or not 0 <= state_slot < state.num_slots:
            raise ValueError(f"room {room}: state slot {state_slot} outside [0, {state.num_slots})")
