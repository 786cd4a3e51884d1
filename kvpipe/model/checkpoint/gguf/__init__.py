"""GGUF checkpoints (llama.cpp's single-file format), read with llama.cpp's own `gguf` package.

reader.py opens a file (or a directory holding one) and refuses what cannot be served; family.py
is what llama.cpp calls a family (GGUFFamily: its `general.architecture` and tensor names, one in
each family's registry entry); config.py turns the metadata into the HF config dict
`ModelConfig.from_hf_dict` reads; tensors.py maps tensor names to HF names and dequantizes
lazily, per tensor or per row range; tokenizer.py builds a `tokenizers.Tokenizer` and a
tokenizer_config-like dict from `tokenizer.ggml.*`; checkpoint.py ties them together
(`GGUFCheckpoint`), the one object the model loader and tokenizer use.
"""
