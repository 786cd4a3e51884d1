"""The scale of every preset's random projections, shared by the families' weight functions.

A projection W [out, in] is drawn with std WEIGHT_GAIN / sqrt(in), so each one keeps the scale of
its (RMS-normed, unit) input: attention scores spread over a few units, so heads attend to chosen
tokens instead of averaging the whole context, and attention and MLP outputs are as large as the
embeddings (std 1) they add to. The next token then depends on the whole context. A fixed std of
0.02 (the presets' format version 1) gave scores of about 0.05 at width 128: uniform attention
and block outputs a twentieth of the embedding, so a random preset mostly continued its last
prompt token, and a wrong KV page or head changed its greedy tokens only now and then."""

from __future__ import annotations

WEIGHT_GAIN = 1.0
