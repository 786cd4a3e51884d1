"""Planning: which bytes of which buffer go where, as vectorised numpy over pages (no I/O).

`layout.py` describes one rank's KV pool as raw buffers and shapes (KVLayout); `tp_mapping.py`
says which prefill rank sends which KV heads to which decode rank when the TP sizes differ;
`planner.py` turns page pairs into coalesced write ops (`op_arrays.py` is their shared array
form, `op_pieces.py` cuts them to transport-sized pieces); `window_table.py` checks a
sliding-window model's window page tables; `wire_bytes.py` predicts the KV bytes a request
puts on the wire.
"""
