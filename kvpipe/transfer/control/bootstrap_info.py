"""What a prefill's bootstrap server holds and a decode checks: the registrations (`PrefillRankInfo`,
one per prefill rank; `PrefillInstanceInfo`, all ranks of one instance), the decode's side
(`DecodeInfo`) and `check_compatible`, and the errors of the bootstrap API.

The server, its client and how calls are authenticated: bootstrap.py, bootstrap_client.py. A
registration is read from JSON a peer sent: `from_dict` refuses anything malformed with a
`BootstrapError` that names the field, never the value (a peer's bytes never reach a client's
error message), and every string is bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpipe.transfer.control.handshake import REFUSED, Handshake, Mismatch, compare, describe, refusal
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.tp_mapping import kv_head_range, transfer_slices

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's convention; the router sends null for "default"
# A registration is a few KB (two addresses per layer); anything near this is garbage or an attack.
MAX_BODY_BYTES = 1 << 20
# An answer holds one registration per prefill rank: a decode reads at most this much of one
# (an unbounded read let a bogus bootstrap host fill the decode's memory).
MAX_ANSWER_BYTES = 16 * MAX_BODY_BYTES
# What a field of hostile JSON can make int()/KVLayout raise: 1e400 parses as inf, int(inf) overflows.
MALFORMED = (KeyError, TypeError, ValueError, OverflowError)
MAX_DETAIL_CHARS = 500  # of a peer's words kept for the log
MAX_NAME_CHARS = 256  # a registration's model name, addresses and ids


def malformed(what: str, e: Exception) -> BootstrapError:
    """A peer's JSON did not parse as `what`: the error says so and the exception's type; the
    exception's text (which may quote the peer's values) goes to `detail`."""
    return BootstrapError(f"malformed {what} ({type(e).__name__})", f"{type(e).__name__}: {e}")


def _text(value: Any, field: str, limit: int = MAX_NAME_CHARS) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{field}: a string of at most {limit} characters")
    return value


class BootstrapError(RuntimeError):
    """The bootstrap server is unreachable, not ready, or answered something unusable. The message
    names the server and what went wrong in our words, and goes to clients; `detail` holds what
    the peer said (its error body, the value it got wrong), for this server's log only."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail[:MAX_DETAIL_CHARS]


class BootstrapNotReady(BootstrapError):
    """The server is up but not every prefill rank has registered yet (worth retrying)."""


class BootstrapUnreachable(BootstrapError):
    """No HTTP answer: connection refused or timed out (worth retrying while the prefill starts)."""


class IncompatiblePeerError(BootstrapError):
    """Prefill and decode cannot exchange KV (model, page size, dtype, layers, TP ...): a refused
    handshake. `mismatches` names each disagreement; `reason` is the first one's /metrics label."""

    def __init__(self, message: str, reason: str, mismatches: tuple[Mismatch, ...] = ()) -> None:
        super().__init__(message if message.startswith(REFUSED) else f"{REFUSED}: {message}")
        self.reason, self.mismatches = reason, mismatches

    @classmethod
    def of(cls, mismatches: tuple[Mismatch, ...], where: str) -> IncompatiblePeerError:
        return cls(f"{describe(mismatches)} ({where})", mismatches[0].reason, mismatches)


class BootstrapRefused(BootstrapError, ValueError):
    """This decode may not fetch from that bootstrap address (--disaggregation-bootstrap-allow,
    or it failed a moment ago). A ValueError too: the engine refuses the request with it."""


def layout_from_dict(d: dict[str, Any]) -> KVLayout:
    return KVLayout(
        **{
            **d,
            "buffer_addrs": tuple(int(a) for a in d["buffer_addrs"]),
            "swa_layers": tuple(int(i) for i in d.get("swa_layers", ())),
        }
    )


@dataclass(frozen=True)
class PrefillRankInfo:
    rank: int
    tp_size: int
    layout: KVLayout
    data_address: str  # transfer backend address of this rank ("ip:port" for Mooncake)
    control_address: str  # ZMQ PULL address of this rank's KVSender ("tcp://ip:port")
    model_name: str
    instance_id: str  # new value on every prefill (re)start
    handshake: Handshake | None = None  # what a decode must agree with (None: not checked, tests)

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["layout"] = self.layout.to_dict()
        d["layout"]["buffer_addrs"] = list(self.layout.buffer_addrs)
        d["handshake"] = None if self.handshake is None else self.handshake.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefillRankInfo:
        try:
            return cls(
                rank=int(d["rank"]),
                tp_size=int(d["tp_size"]),
                layout=layout_from_dict(d["layout"]),
                data_address=_text(d["data_address"], "data_address"),
                control_address=_text(d["control_address"], "control_address"),
                model_name=_text(d["model_name"], "model_name"),
                instance_id=_text(d["instance_id"], "instance_id", 64),
                handshake=None if d.get("handshake") is None else Handshake.from_dict(d["handshake"]),
            )
        except MALFORMED as e:
            raise malformed("prefill rank info", e) from e


@dataclass(frozen=True)
class PrefillInstanceInfo:
    instance_id: str
    tp_size: int
    model_name: str
    ranks: tuple[PrefillRankInfo, ...]  # ranks[i].rank == i

    @property
    def handshake(self) -> Handshake | None:
        """The instance's handshake (every rank registers the same one: _Registry.put)."""
        return self.ranks[0].handshake if self.ranks else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefillInstanceInfo:
        try:
            ranks = tuple(sorted((PrefillRankInfo.from_dict(r) for r in d["ranks"]), key=lambda r: r.rank))
            inst = cls(
                _text(d["instance_id"], "instance_id", 64),
                int(d["tp_size"]),
                _text(d["model_name"], "model_name"),
                ranks,
            )
        except MALFORMED as e:
            raise malformed("prefill instance info", e) from e
        if [r.rank for r in ranks] != list(range(inst.tp_size)):
            raise BootstrapError(
                f"prefill instance {inst.instance_id}: ranks {[r.rank for r in ranks]} "
                f"do not cover tp_size {inst.tp_size}"
            )
        return inst


@dataclass(frozen=True)
class DecodeInfo:
    model_name: str
    tp_size: int
    layouts: tuple[KVLayout, ...]  # one per decode rank
    handshake: Handshake | None = None  # None: not checked (tests that build bare senders and receivers)


def check_compatible(prefill: PrefillInstanceInfo, decode: DecodeInfo) -> None:
    """Raise IncompatiblePeerError naming both sides' values if KV cannot move from `prefill`
    to `decode`: the served model name, the handshakes (handshake.py: every field they disagree
    on), each rank pair's layout, the TP mapping."""
    where = f"prefill instance {prefill.instance_id}"
    if prefill.model_name != decode.model_name:
        raise IncompatiblePeerError.of(
            refusal("served model name", "model_name", prefill.model_name, decode.model_name), where
        )
    mine, theirs = decode.handshake, prefill.handshake
    if (mine is None) != (theirs is None):
        has = lambda h: "a handshake" if h is not None else "none"  # noqa: E731
        raise IncompatiblePeerError.of(refusal("handshake", "handshake", has(theirs), has(mine)), where)
    if mine is not None and theirs is not None:
        mismatches = compare(theirs, mine)
        if mismatches:
            raise IncompatiblePeerError.of(mismatches, where)
    if len(decode.layouts) != decode.tp_size:
        raise IncompatiblePeerError(f"decode has tp_size {decode.tp_size} but {len(decode.layouts)} layouts", "tp")
    for p in prefill.ranks:
        for d_rank, d in enumerate(decode.layouts):
            why = p.layout.compatible_with(d)
            if why:
                raise IncompatiblePeerError(
                    f"{where} rank {p.rank} vs decode rank {d_rank}: "
                    + why.replace(" here ", " on the prefill ").replace("on the peer", "on the decode"),
                    "kv_layout",
                )
    total = decode.layouts[0].total_kv_heads
    try:
        transfer_slices(prefill.tp_size, decode.tp_size, total)
        for side, tp, layouts in (
            ("prefill", prefill.tp_size, [p.layout for p in prefill.ranks]),
            ("decode", decode.tp_size, decode.layouts),
        ):
            for rank, lay in enumerate(layouts):
                want = kv_head_range(tp, rank, total)
                if (lay.head_start, lay.head_end) != want:
                    raise ValueError(
                        f"{side} rank {rank} holds KV heads [{lay.head_start}, {lay.head_end}), "
                        f"TP {tp} needs [{want[0]}, {want[1]})"
                    )
    except ValueError as e:
        raise IncompatiblePeerError(f"{where}: TP {prefill.tp_size} -> decode TP {decode.tp_size}: {e}", "tp") from e
