"""``python -m slidedp_lightning.export CHECKPOINT_DIR OUT_DIR``: the offline Hugging Face export command. Its code
is :mod:`slidedp_lightning.hf.export_cli`."""
