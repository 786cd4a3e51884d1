"""A PD pair (one KVSender, one KVReceiver, local backend, auth token from the environment) in its
own process, so a test can attack its control endpoints and read the process's peak RSS from
/proc without counting its own memory.

    python -m tests.helpers.frame_victim       # KVPIPE_DISAGGREGATION_AUTH_TOKEN set
    -> {"prefill", "decode"}                  # the control addresses, one JSON line
    <- "transfer"  -> {"ok", "sender_rooms", "receiver_rooms", "malformed", "auth_rejected"}
    <- "quit"

`transfer` runs one room end to end and reports the rooms both books still hold afterwards (0
when nothing leaked) and the frames both endpoints dropped."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import sys

import numpy as np

from kvpipe.transfer.backends.local import LocalFabric
from kvpipe.transfer.control.auth import token_from_env
from kvpipe.transfer.lifecycle import TransferState
from tests.helpers.kv_transfer import CFG, PAGES, SRC, Results, assert_moved, start_decode, start_prefill


def main() -> None:
    cfg = dataclasses.replace(CFG, auth_token=token_from_env())
    rooms = itertools.count(1)
    with contextlib.ExitStack() as stack:
        fabric = LocalFabric()
        prefill = start_prefill(stack, fabric=fabric, cfg=cfg)
        recv = start_decode(stack, fabric=fabric, cfg=cfg)
        sender = prefill.senders[0]
        print(json.dumps({"prefill": sender.control_address, "decode": recv.control_address}), flush=True)
        for line in sys.stdin:
            if line.strip() != "transfer":
                break
            room = next(rooms)
            dst = np.arange(6) + 6 * (room % 4)
            sender.add_room(room, SRC)
            recv.add_room(room, "127.0.0.1", prefill.port, dst)
            sender.send(room, 0, 22, last=True, aux=(5, -0.1))
            ok = Results(sender).get(room)[1] is TransferState.SUCCESS
            ok = ok and Results(recv).get(room)[1] is TransferState.SUCCESS
            if room == 1:  # the first transfer: every other page is still zero
                assert_moved(prefill, recv, SRC, dst, np.setdiff1d(np.arange(PAGES), dst))
            eps = (sender._endpoint, recv._endpoint)
            out = {
                "ok": ok,
                "sender_rooms": sender.num_rooms(),
                "receiver_rooms": recv.num_rooms(),
                "malformed": sum(ep.stats.malformed for ep in eps),
                "auth_rejected": sum(ep.stats.auth_rejected for ep in eps),
            }
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
