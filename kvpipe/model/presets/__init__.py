"""Built-in models: deterministic random weights written as real HF checkpoint directories.

writer.py names every preset and writes one (write_preset, preset_config); cache.py keeps
written ones on disk (default_model_dir, model_path_or_preset). The specs, HF config keys and
tensors of each family's presets: llama.py (dense Llama and the Llama-shaped MoE families:
Qwen3-MoE, MiniMax-M2, DeepSeek-V3 with deepseek.py's MLA parts), qwen3_5.py, gpt_oss.py, gemma3.py; the
tokenizer every preset shares: tokenizer.py.
"""

from kvpipe.model.presets.cache import default_model_dir, model_path_or_preset
from kvpipe.model.presets.llama import PRESETS
from kvpipe.model.presets.writer import preset_config, preset_names, write_preset

__all__ = [
    "PRESETS",
    "default_model_dir",
    "model_path_or_preset",
    "preset_config",
    "preset_names",
    "write_preset",
]
