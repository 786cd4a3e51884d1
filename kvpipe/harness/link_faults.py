"""Faults on the testbed's link: packet loss, partitions and flaps (nftables inside each namespace),
delay, jitter and reordering (netem under each end's tbf, where the kernel has netem).

    fault = LinkFault.parse("partition:6s")          # or loss:1%:30s, flap:1s/2s:20s, delay:50ms:30s,
    with FaultRun(tb.spec, fault, start_after_s=5):  # jitter:50ms/10ms:30s, reorder:25%/10ms:30s
        ...  # a load runs; the fault starts 5 s in and heals after its duration (or at exit)

Loss, partitions and flaps drop packets arriving on each namespace's veth end (`iifname`), so both
directions suffer and each namespace's own loopback traffic does not; one nftables table per
namespace (TABLE) holds the rule, and deleting it heals. netem is a child of the tbf (handle 1:,
class 1:1) on both ends, so the rate stays shaped; deleting it heals. This kernel may lack netem
(`tc qdisc ... netem`: "Specified qdisc kind is unknown", docs/architecture.md): `netem_missing()`
says why, and tests skip those kinds by name with it.
"""

from __future__ import annotations

import enum
import re
import secrets
import threading
import time
from dataclasses import dataclass, field

from kvpipe.harness.testbed import LinkSpec, LinkTestbedError, _run, tool

TABLE = "kvpipe_fault"  # the nftables table (family inet) a fault adds in each namespace
NETEM_HANDLE = "10:"  # netem's handle under the tbf's class 1:1


class FaultKind(enum.Enum):
    LOSS = "loss"  # drop a share of the packets, both ways
    PARTITION = "partition"  # drop everything for the duration, then heal
    FLAP = "flap"  # down for down_s, up for up_s, repeated for the duration
    DELAY = "delay"  # netem: a fixed one-way delay on both ends
    JITTER = "jitter"  # netem: delay with a random variation
    REORDER = "reorder"  # netem: a share of the packets sent at once, the rest delayed

    @property
    def netem(self) -> bool:
        return self in (FaultKind.DELAY, FaultKind.JITTER, FaultKind.REORDER)


_DURATION = r"(\d+(?:\.\d+)?)s"
_PATTERNS = {
    FaultKind.LOSS: re.compile(rf"^(\d+(?:\.\d+)?)%:{_DURATION}$"),
    FaultKind.PARTITION: re.compile(rf"^{_DURATION}$"),
    FaultKind.FLAP: re.compile(rf"^{_DURATION}/{_DURATION}:{_DURATION}$"),
    FaultKind.DELAY: re.compile(rf"^(\d+(?:\.\d+)?)ms:{_DURATION}$"),
    FaultKind.JITTER: re.compile(rf"^(\d+(?:\.\d+)?)ms/(\d+(?:\.\d+)?)ms:{_DURATION}$"),
    FaultKind.REORDER: re.compile(rf"^(\d+(?:\.\d+)?)%/(\d+(?:\.\d+)?)ms:{_DURATION}$"),
}
SYNTAX = (
    "loss:PCT%:DUR, partition:DUR, flap:DOWN/UP:DUR, delay:MSms:DUR, jitter:MSms/MSms:DUR or "
    "reorder:PCT%/MSms:DUR, durations in seconds (e.g. 6s)"
)


@dataclass(frozen=True)
class LinkFault:
    """One fault and how long it lasts. `duration_s`: from its start to its heal (a flap's whole
    episode, alternating down_s / up_s from down)."""

    kind: FaultKind
    duration_s: float
    loss_pct: float = 0.0  # LOSS
    down_s: float = 0.0  # FLAP
    up_s: float = 0.0  # FLAP
    delay_ms: float = 0.0  # DELAY, JITTER, REORDER (the delay of the packets not sent at once)
    jitter_ms: float = 0.0  # JITTER
    reorder_pct: float = 0.0  # REORDER

    def __post_init__(self) -> None:
        if self.duration_s <= 0:
            raise ValueError(f"a link fault lasts a positive time, got {self.duration_s}s")
        if self.kind is FaultKind.LOSS and not 0 < self.loss_pct <= 100:
            raise ValueError(f"loss must be in (0, 100]%, got {self.loss_pct}")
        if self.kind is FaultKind.FLAP and min(self.down_s, self.up_s) <= 0:
            raise ValueError(f"a flap needs positive down and up times, got {self.down_s}/{self.up_s}")
        if self.kind.netem and self.delay_ms <= 0:
            raise ValueError(f"{self.kind.value} needs a positive delay, got {self.delay_ms} ms")
        if self.kind is FaultKind.REORDER and not 0 < self.reorder_pct < 100:
            raise ValueError(f"reorder must be in (0, 100)%, got {self.reorder_pct}")

    @classmethod
    def parse(cls, text: str) -> LinkFault:
        """`kind:params` as in SYNTAX; ValueError naming the syntax otherwise."""
        kind_s, _, rest = text.strip().lower().partition(":")
        try:
            kind = FaultKind(kind_s)
        except ValueError:
            raise ValueError(f"unknown link fault {text!r}: expected {SYNTAX}") from None
        m = _PATTERNS[kind].match(rest)
        if m is None:
            raise ValueError(f"bad link fault {text!r}: expected {SYNTAX}")
        v = [float(x) for x in m.groups()]
        if kind is FaultKind.LOSS:
            return cls(kind, v[1], loss_pct=v[0])
        if kind is FaultKind.PARTITION:
            return cls(kind, v[0])
        if kind is FaultKind.FLAP:
            return cls(kind, v[2], down_s=v[0], up_s=v[1])
        if kind is FaultKind.DELAY:
            return cls(kind, v[1], delay_ms=v[0])
        if kind is FaultKind.JITTER:
            return cls(kind, v[2], delay_ms=v[0], jitter_ms=v[1])
        return cls(kind, v[2], reorder_pct=v[0], delay_ms=v[1])

    @property
    def label(self) -> str:
        """What it is, for tables: "loss 1% 30 s", "partition 6 s", "flap 1/2 s 20 s", ..."""
        what = {
            FaultKind.LOSS: f"loss {self.loss_pct:g}%",
            FaultKind.PARTITION: "partition",
            FaultKind.FLAP: f"flap {self.down_s:g}/{self.up_s:g} s",
            FaultKind.DELAY: f"delay {self.delay_ms:g} ms",
            FaultKind.JITTER: f"jitter {self.delay_ms:g}±{self.jitter_ms:g} ms",
            FaultKind.REORDER: f"reorder {self.reorder_pct:g}% / {self.delay_ms:g} ms",
        }[self.kind]
        return f"{what} {self.duration_s:g} s"


def drop_rule(veth: str, loss_pct: float | None) -> str:
    """The nftables rule that drops packets arriving on `veth`: all of them (None), else `loss_pct`
    percent, drawn per packet (in 1/10,000ths: 0.1% is 10)."""
    if loss_pct is None:
        return f'iifname "{veth}" drop'
    return f'iifname "{veth}" numgen random mod 10000 < {round(loss_pct * 100)} drop'


def nft_commands(spec: LinkSpec, rule: str | None) -> list[list[str]]:
    """Per namespace: our table's input chain holding just `rule` for that end's veth (`rule`
    formatted with {veth}), in one nft transaction (a flap never passes a packet between two rules);
    None: delete the table (heal; deleting a missing table fails, which heal ignores)."""
    cmds: list[list[str]] = []
    for ns, veth in ((spec.ns_a, spec.veth_a), (spec.ns_b, spec.veth_b)):
        nft = ["ip", "netns", "exec", ns, tool("nft")]
        if rule is None:
            cmds.append([*nft, "delete", "table", "inet", TABLE])
            continue
        chain = f"inet {TABLE} input"
        cmds.append(
            [
                *nft,
                f"add table inet {TABLE}; flush table inet {TABLE}; "
                f"add chain {chain} {{ type filter hook input priority 0; policy accept; }}; "
                f"add rule {chain} {rule.format(veth=veth)}",
            ]
        )
    return cmds


def netem_args(fault: LinkFault) -> list[str]:
    """`tc qdisc ... netem` arguments for a delay, jitter or reorder fault."""
    args = ["delay", f"{fault.delay_ms:g}ms"]
    if fault.kind is FaultKind.JITTER:
        args.append(f"{fault.jitter_ms:g}ms")
    if fault.kind is FaultKind.REORDER:
        # reorder P%: P% of packets go at once, the rest wait delay_ms (so they overtake)
        args += ["reorder", f"{fault.reorder_pct:g}%", "50%"]
    return args


def netem_commands(spec: LinkSpec, fault: LinkFault | None) -> list[list[str]]:
    """Add (or, with None, delete) netem under both ends' tbf (testbed.setup_commands: handle 1:)."""
    cmds = []
    for ns, veth in ((spec.ns_a, spec.veth_a), (spec.ns_b, spec.veth_b)):
        base = ["tc", "-n", ns, "qdisc"]
        where = ["dev", veth, "parent", "1:1", "handle", NETEM_HANDLE]
        cmds.append([*base, "del", *where] if fault is None else [*base, "add", *where, "netem", *netem_args(fault)])
    return cmds


_netem_probe: dict[str, str | None] = {}


def nft_missing() -> str | None:
    """Why nftables faults cannot run here (None: they can)."""
    return None if tool("nft") != "nft" else "`nft` not found: install nftables"


def netem_missing() -> str | None:
    """Why netem faults cannot run here (None: they can): probed once per process, in a throwaway
    namespace, on its loopback."""
    if "why" not in _netem_probe:
        ns = f"kvnetem{secrets.token_hex(3)}"
        try:
            _run(["ip", "netns", "add", ns])
            r = _run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
            _netem_probe["why"] = None if r.returncode == 0 else f"no netem qdisc in this kernel: {r.stderr.strip()}"
        except LinkTestbedError as e:
            _netem_probe["why"] = f"cannot probe for netem: {e}"
        finally:
            _run(["ip", "netns", "del", ns], check=False)
    return _netem_probe["why"]


@dataclass
class LinkFaults:
    """Apply and heal faults on one testbed's link (the testbed must be up)."""

    spec: LinkSpec
    _netem_on: bool = field(default=False, init=False)

    def drop(self, loss_pct: float | None) -> None:
        """Drop `loss_pct`% of the packets both ways (None: all of them: a partition)."""
        if (why := nft_missing()) is not None:
            raise LinkTestbedError(why)
        for cmd in nft_commands(self.spec, drop_rule("{veth}", loss_pct)):
            _run(cmd)

    def netem(self, fault: LinkFault) -> None:
        if (why := netem_missing()) is not None:
            raise LinkTestbedError(why)
        if self._netem_on:
            for cmd in netem_commands(self.spec, None):
                _run(cmd, check=False)
        for cmd in netem_commands(self.spec, fault):
            _run(cmd)
        self._netem_on = True

    def heal(self) -> None:
        """Remove every fault (idempotent: what is not there is ignored)."""
        if nft_missing() is None:
            for cmd in nft_commands(self.spec, None):
                _run(cmd, check=False)
        if self._netem_on:
            for cmd in netem_commands(self.spec, None):
                _run(cmd, check=False)
            self._netem_on = False


class FaultRun:
    """A fault applied on a thread while the caller's load runs: `start_after_s` after entering, for
    its duration (a flap toggles meanwhile), healed when the duration ends and always at exit.
    `applied_at` / `healed_at`: time.monotonic() readings (None: not yet)."""

    def __init__(self, spec: LinkSpec, fault: LinkFault, start_after_s: float = 0.0) -> None:
        if fault.kind.netem and (why := netem_missing()) is not None:
            raise LinkTestbedError(f"{fault.kind.value}: {why}")
        if not fault.kind.netem and (why := nft_missing()) is not None:
            raise LinkTestbedError(why)
        self.fault, self.start_after_s = fault, start_after_s
        self.faults = LinkFaults(spec)
        self.applied_at: float | None = None
        self.healed_at: float | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="link-fault", daemon=True)

    def __enter__(self) -> FaultRun:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60.0)
        self._heal()

    def wait_healed(self, timeout_s: float) -> bool:
        """Block until the fault has been applied and healed (or the timeout): True if healed."""
        self._thread.join(timeout_s)
        return self.healed_at is not None

    def _heal(self) -> None:
        with self._lock:
            self.faults.heal()
            if self.applied_at is not None and self.healed_at is None:
                self.healed_at = time.monotonic()

    def _run(self) -> None:
        f = self.fault
        try:
            if self._stop.wait(self.start_after_s):
                return
            with self._lock:
                self.applied_at = time.monotonic()
                self._apply_first()
            end = self.applied_at + f.duration_s
            if f.kind is FaultKind.FLAP:
                self._flap(end)
            self._stop.wait(max(0.0, end - time.monotonic()))
        except BaseException as e:  # noqa: BLE001 - reported to the caller through .error
            self.error = e
        finally:
            self._heal()

    def _apply_first(self) -> None:
        f = self.fault
        if f.kind.netem:
            self.faults.netem(f)
        else:
            self.faults.drop(f.loss_pct if f.kind is FaultKind.LOSS else None)

    def _flap(self, end: float) -> None:
        """Down (applied already) for down_s, up for up_s, ... until `end` (bounded by it)."""
        f, down = self.fault, True
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= end:
                return
            if self._stop.wait(min(f.down_s if down else f.up_s, end - now)):
                return
            with self._lock:
                if down:
                    self.faults.heal()
                else:
                    self.faults.drop(None)
            down = not down
