"""`kvpipe init-model`: write a built-in preset checkpoint directory (real HF format, seeded weights)."""

from __future__ import annotations

import argparse

PRESETS = (
    "tiny",
    "bench",
    "tiny-qwen3-moe",
    "tiny-minimax-m2",
    "tiny-deepseek-v3",
    "tiny-qwen3.5",
    "tiny-qwen3.5-moe",
    "tiny-gpt-oss",
    "tiny-gemma3",
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", choices=PRESETS, help="which built-in model shape")
    p.add_argument("--out", required=True, help="directory to write the checkpoint into")
    p.add_argument("--seed", type=int, default=0, help="weight seed")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from kvpipe.model.presets import write_preset  # torch: not on `--help`'s path

    print(write_preset(args.preset, args.out, seed=args.seed))
    return 0
