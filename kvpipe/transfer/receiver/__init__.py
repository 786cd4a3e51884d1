"""The decode side of a transfer: one `KVReceiver` per decode instance (`kv_receiver.py`: threads,
bootstrap fetches, control messages; it speaks for every decode rank), driving `ReceiverBook`
(`book.py`: every decision, no I/O) and one `ReceiverRoom` per request (`room.py`: the final
statuses due, aux data, when pages are safe to reuse).
"""
