"""Hugging Face interop for every family: Llama (`llama.py`), Mixtral (`mixtral.py`), Qwen3 and Qwen3-MoE
(`qwen3.py`), DeepSeek-V3 (`deepseek_v3.py`) configs and weight names, the export of a checkpoint with its tokenizer
(`export.py`) and the import of HF weights (`importer.py`). Parameter names are the same on both sides (nanotron's
model uses HF's names)."""
