"""Per-position recurrent states of a speculative verify forward (hybrid models), and the copies
that commit the accepted one.

A verify forward runs the target over [x_0 .. x_k] (the last token and k drafts) of each row in
one pass; a linear-attention layer's state advances with every one of them, and which of them the
target accepts is known only after the logits. So the forward keeps the state after each input,
per running slot (SGLang's "intermediate" SSM and conv states of its target verify), and writes
the state after the last input into the row's own slot as any forward does; once the engine knows
that inputs x_0 .. x_{n-1} were kept, the state after x_{n-1} is copied back into the slot (none
when every input was kept), and accepted positions that the hybrid prefix cache snapshots are
copied into their snapshot slots. The copies are applied at the start of the next forward on
every TP rank (ForwardSpec.state_commits), before anything reads those slots.

Per linear-attention layer (this rank's heads, shapes as kvpipe/cache/recurrent_pool.py):
- conv: [running slots, positions, conv_dim, conv_kernel - 1], the conv inputs after input j;
- recurrent: [running slots, positions, heads, key_dim, value_dim] fp32, the delta-rule state.
`positions` is the most inputs one verify row runs: max drafts + 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class VerifyStates:
    def __init__(
        self, conv: Sequence[torch.Tensor], recurrent: Sequence[torch.Tensor], running_slots: int, positions: int
    ) -> None:
        """Buffers for the first `running_slots` slots of a StatePool whose per-layer buffers are
        `conv` and `recurrent` (the running requests' slots come before the prefix cache's snapshot
        slots), `positions` states each."""
        if not conv or running_slots > conv[0].shape[0] or positions < 1:
            raise ValueError(f"{running_slots} running slots of a pool, {positions} positions")
        self.running_slots = running_slots
        self.positions = positions
        self.conv = [torch.zeros(running_slots, positions, *c.shape[1:], dtype=c.dtype, device=c.device) for c in conv]
        self.recurrent = [
            torch.zeros(running_slots, positions, *r.shape[1:], dtype=r.dtype, device=r.device) for r in recurrent
        ]

    def check_rows(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """A verify forward of rows in `slots` with `lengths` inputs each fits these buffers."""
        bad = [(s, n) for s, n in zip(slots, lengths) if not (0 <= s < self.running_slots and 1 <= n <= self.positions)]
        if bad:
            raise ValueError(
                f"verify rows (slot, inputs) {bad} outside {self.running_slots} running slots "
                f"x {self.positions} positions"
            )

    def commit(
        self, conv: Sequence[torch.Tensor], recurrent: Sequence[torch.Tensor], copies: Sequence[tuple[int, int, int]]
    ) -> None:
        """(slot, j, dst): every layer's state after input j of the last verify forward of running
        slot `slot` into the pool's slot `dst` (`conv`, `recurrent`: the pool's buffers; the slot
        itself: a rollback; a snapshot slot: the prefix cache's copy of an accepted position)."""
        if not copies:
            return
        device = self.conv[0].device
        src, pos, dst = (torch.tensor(c, dtype=torch.int64, device=device) for c in zip(*copies))
        for mine, pool in ((self.conv, conv), (self.recurrent, recurrent)):
            for i, buf in enumerate(pool):
                buf[dst] = mine[i][src, pos]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self.conv, *self.recurrent))
