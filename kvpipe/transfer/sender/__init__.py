"""The prefill side of a transfer: one `KVSender` per prefill TP rank (`kv_sender.py`: threads,
sockets, the backend), driving `SenderBook` (`book.py`: every decision, no I/O; its docstring maps
the pure parts it is made of), which keeps the decode peers it serves (`peers.py`) and one
`SenderRoom` per request (`room.py`: destinations, queued sends, per-layer cursors, coalesced write
batches).
"""
