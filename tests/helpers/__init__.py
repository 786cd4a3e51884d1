"""What the test modules share, imported as tests.helpers.<module> (the repository root is on
pytest's sys.path); fixtures live in the conftest.py files. Failed asserts in these modules are
rewritten like a test's (tests/conftest.py registers the package).

Models: paged_model (drive a CausalLM through the paged KV pool), hybrid_model (random Qwen3.5
checkpoints and their driver), hf_models / hf_gpt_oss / hf_deepseek_v3 (random tiny HF
checkpoints per family), moe_block (SparseMoE next to HF's MoE blocks), tolerance (how close
two runs' logits must be, and the exactness check of two generations: tokens and logprobs,
assert_same_generations), corrupt_kv (negative controls: one page, head slice or state slot
corrupted on purpose), tp_ranks (a function on every rank of a gloo process group),
preset_digests, gguf_files (small GGUF files written with gguf.GGUFWriter), trained_models (the
trained GGUFs: SmolLM2 and the catalog's Qwen2.5-Coder, fetched on first use, with transformers'
tokenizer and model of each).
Engine and scheduler: engine, recording_connector, scheduler_steps.
Transfer and PD: kv_transfer (sender/receiver rigs), bootstrap_info, wire_maps, pd_pair (prefill
and decode engines in one process), pd_parity (PD against colocated), prefix_prompts.
Servers: server (a `kvpipe serve` subprocess), pd_stack (prefill + decode + router)."""
