"""`kvpipe bench transfer` (command.py): KV goodput between a prefill and a decode process over
Mooncake against raw transfers; and the control plane's per-frame cost (frame_checks.py)."""
