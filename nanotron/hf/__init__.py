"""Hugging Face interop for every family: Llama (`llama.py`) and Mixtral (`mixtral.py`) configs and weight names,
the export of a checkpoint with its tokenizer (`export.py`) and the import of HF weights (`importer.py`).
Parameter names are the same on both sides (nanotron's model uses HF's names)."""
