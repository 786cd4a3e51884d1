"""`kvpipe bench kv-store` (command.py): the KV tier on Mooncake Store, prefix loaded against
computed, multi-turn routing (routing.py) and put/get goodput (goodput.py)."""
