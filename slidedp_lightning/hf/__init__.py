"""Hugging Face in and out: :mod:`.pretrained` (``from_pretrained``: a meta skeleton whose weights stream from the
safetensors files into the ledger), :mod:`.export` (``save_pretrained`` directories from the ledger or, offline,
from a distributed checkpoint), :mod:`.peft` (LoRA merged or as adapters) and :mod:`.export_cli` (the offline
export command, ``python -m slidedp_lightning.export``)."""
