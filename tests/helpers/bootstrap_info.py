"""What a prefill rank registers with the bootstrap server, made up for the tests: a KV layout of
2 layers and 2 KV heads (sliced by TP) at fake addresses, and a rank's PrefillRankInfo."""

from __future__ import annotations

from kvpipe.transfer.control.bootstrap import PrefillRankInfo
from kvpipe.transfer.planning.layout import KVLayout


def layout(kv_heads=2, head_start=0, total=2, layers=2, page_size=4, dtype="float32", base=1 << 20) -> KVLayout:
    page = kv_heads * page_size * 8 * 4
    return KVLayout(
        num_layers=layers,
        page_size=page_size,
        kv_heads=kv_heads,
        head_start=head_start,
        total_kv_heads=total,
        head_dim=8,
        dtype=dtype,
        itemsize=4,
        buffer_addrs=tuple(base + i * (1 << 16) for i in range(2 * layers)),
        buffer_nbytes=16 * page,
    )


def rank_info(rank=0, tp=1, instance="inst-a", model="m", **kw) -> PrefillRankInfo:
    heads = 2 // tp
    return PrefillRankInfo(
        rank=rank,
        tp_size=tp,
        layout=layout(kv_heads=heads, head_start=rank * heads, **kw),
        data_address=f"127.0.0.1:{17000 + rank}",
        control_address=f"tcp://127.0.0.1:{18000 + rank}",
        model_name=model,
        instance_id=instance,
    )
