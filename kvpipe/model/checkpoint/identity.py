"""A checkpoint's identity by content: the digest a PD prefill and decode compare at bootstrap
(transfer/control/handshake.py), so two different checkpoints served under one name are refused.

What goes in (SHA-256, each part length-prefixed):
- config.json as canonical JSON (sorted keys), and the tokenizer files, whole (they are small;
  a different tokenizer gives the two sides different prompts);
- every weight file's size (and name, inside a directory), and
  - safetensors: its whole header (every tensor's name, dtype, shape and byte range) and, of
    every tensor, `SAMPLE_BYTES` at its start, middle and end;
  - GGUF (and anything else): its first `HEAD_BYTES` (metadata: architecture and
    hyperparameters) and `FILE_SAMPLES` blocks of `SAMPLE_BYTES` at evenly spaced offsets.

Why sampling is enough: the digest must tell apart checkpoints that would give different KV,
not resist forgery (the peers share an auth token already). Training, fine-tuning, a different
seed or a different quantization changes nearly every element of every tensor it touches, so
every sample of such a tensor differs; a per-tensor sample covers a change confined to one tensor
(a re-trained lm_head), shapes and dtypes are in the header. What it misses: an edit of a few
bytes between samples. Reading a few hundred KiB costs milliseconds for SmolLM2-135M (98 MB
GGUF, ~270 tensors) and stays milliseconds for a 100 GB checkpoint, where hashing every byte
would take minutes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

SAMPLE_BYTES = 64  # per sample
HEAD_BYTES = 1 << 20  # of a file without a tensor index we parse (GGUF): its metadata
FILE_SAMPLES = 4096  # evenly spaced samples of such a file (256 KiB)
MAX_HEADER_BYTES = 100 << 20  # a safetensors header larger than this is not one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


def checkpoint_digest(path: str | Path) -> str:
    """Hex SHA-256 identifying the checkpoint at `path` (an HF directory or a single file)."""
    p = Path(path)
    h = hashlib.sha256(b"kvpipe-checkpoint-digest-v1")
    if p.is_dir():
        config = p / "config.json"
        if config.is_file():
            _part(h, b"config", json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
        for name in TOKENIZER_FILES:
            if (p / name).is_file():
                _part(h, name.encode(), (p / name).read_bytes())
        for f in sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES)):
            _file(h, f, f.name)  # a directory's shards by name: their split is part of the checkpoint
    else:
        _file(h, p, "")  # a single file's name is not (a copy under another name is the same model)
    return h.hexdigest()


def _part(h: hashlib._Hash, tag: bytes, data: bytes) -> None:
    h.update(struct.pack("<QQ", len(tag), len(data)))
    h.update(tag)
    h.update(data)


def _file(h: hashlib._Hash, f: Path, name: str) -> None:
    size = f.stat().st_size
    _part(h, b"file", f"{name}:{size}".encode())
    with open(f, "rb") as fh:
        fd = fh.fileno()
        if f.suffix == ".safetensors" and _safetensors(h, fd, size):
            return
        _part(h, b"head", os.pread(fd, min(size, HEAD_BYTES), 0))
        if size > HEAD_BYTES:
            step = (size - HEAD_BYTES) // FILE_SAMPLES or 1
            for off in range(HEAD_BYTES, size, step):
                h.update(os.pread(fd, SAMPLE_BYTES, off))


def _safetensors(h: hashlib._Hash, fd: int, size: int) -> bool:
    """Header and per-tensor samples of a safetensors file; False if it is not one."""
    if size < 8:
        return False
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n > min(size - 8, MAX_HEADER_BYTES):
        return False
    raw = os.pread(fd, n, 8)
    try:
        header = json.loads(raw)
    except ValueError:
        return False
    if not isinstance(header, dict):
        return False
    _part(h, b"header", raw)
    base = 8 + n
    for name in sorted(k for k in header if k != "__metadata__"):
        info = header[name]
        begin, end = (int(x) for x in info["data_offsets"])
        for off in sorted({begin, (begin + end) // 2, max(begin, end - SAMPLE_BYTES)}):
            h.update(os.pread(fd, min(SAMPLE_BYTES, end - off), base + off))
    return True
