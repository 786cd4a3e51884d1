"""Recurrent state of hybrid models (Qwen3.5's gated delta-net layers) as the transfer sees it:
`layout.py` describes one rank's state pool (conv and recurrent buffers per linear layer, the
rank's linear heads), `plan.py` turns a request's state slot into write ops, sliced by heads
when the two TP sizes differ. The pool itself is kvpipe/cache/recurrent_pool.py.
"""
