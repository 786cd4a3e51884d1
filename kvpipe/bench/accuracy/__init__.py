"""`kvpipe bench kv-accuracy` (kv_dtype.py) and `kvpipe bench quant-accuracy` (quantization.py)."""
