"""The EAGLE drafter (SGLang's --speculative-algorithm EAGLE --speculative-draft-model-path
<head>): an EAGLE(-1/2) head (model/draft/eagle.py) drafting for a Llama-family target, run by the
NEXTN drafter's machinery (engine/spec/mtp_drafter.py) with only the head and its KV pool swapped in.

Why nothing else changes: the head takes what DeepSeek-V3's MTP layer takes, at the same
positions (row i from the target's post-norm hidden state h_i and the token t_{i+1}, its KV at
position i), and feeds its own output hidden state forward along the chain (a chain of topk 1, as
EAGLE's first step). So the catch-up over the positions a request's head KV lacks, the chain, the
head KV on the target pool's page ids (freed with them, cached with them), the copy on write of a
cached page's last row where a request leaves it at the page boundary, rollback (nothing but
recomputing past the valid prefix) and PD (disagg/mtp_transfer.py: the head KV as the last layer
group, h_{L-1} in AuxData.hidden) are MTPDrafter's. What differs is the pool: the head's GQA layer
keeps K and V ([pages, its KV heads, page, head dim] each), not an MLA latent.

Built for TP 1 on the head: with a TP target the head runs whole on rank 0, where the target's
hidden states, embedding and lm_head are complete. In PD, at any TP on either side, its KV pool
(the K and V of all its KV heads, never head-sliced) lives on TP rank 0 of each side as the MTP
layer's does, and prefill rank 0 writes it whole into decode rank 0 (disagg/mtp_transfer.py).
"""

from __future__ import annotations

from kvpipe.config import ServerConfig
from kvpipe.engine.spec.mtp_drafter import MTPDrafter
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.draft.eagle import check_eagle_head, eagle_config, load_eagle
from kvpipe.model.draft.mtp_layer import MTPLayer


def check_eagle(cfg: ServerConfig, target: ModelConfig) -> None:
    """Refuse an EAGLE head that does not fit the target (hidden size, vocabulary, a
    non-Llama-family target): ConfigError. Any TP, colocated or PD: the head runs whole on TP rank
    0 and, in PD, its KV moves from prefill rank 0 to decode rank 0 (disagg/mtp_transfer.py)."""
    path = cfg.speculative.eagle_head_path
    assert path is not None
    check_eagle_head(eagle_config(path), target, path)


class EagleDrafter(MTPDrafter):
    """MTPDrafter with an EAGLE head in place of the MTP layer (see the module docstring)."""

    def load_head(self, cfg: ServerConfig, target_cfg: ModelConfig, device: str) -> MTPLayer:
        check_eagle(cfg, target_cfg)
        path = cfg.speculative.eagle_head_path
        assert path is not None
        return load_eagle(path, target_cfg, device, dtype=None if cfg.dtype == "auto" else cfg.dtype)
