"""Staging for heterogeneous TP: head slices gathered into one contiguous chunk per write.

`buffers.py` holds the tensor side (the prefill's gather buffer, the decode's staging agent
that scatters landed chunks into its KV pages); `book.py` is what the decode's agent decides
(slot grants, landed chunks, flow control) and `ring.py` the ring allocator both sides carve
slots from; `waits.py` counts how long slot requests queued for the ring (a /metrics histogram).
Plain bookkeeping in book.py, ring.py and waits.py; tensors only in buffers.py.
"""
