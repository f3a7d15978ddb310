"""Example recipes built on the slidedp strategy.

* :mod:`slidedp_lightning.recipes.synthetic`: a seed-deterministic synthetic
  sequence task (data set and answer-token accuracy).
* :mod:`slidedp_lightning.recipes.finetune`: the fine-tuning job
  (``slidedp-finetune`` command, ``experiments/finetune.py``).
* :mod:`slidedp_lightning.recipes.data`: JSONL prompt/completion and chat data (``--data``): checks, label
  masks, padded rows.
* :mod:`slidedp_lightning.recipes.own_data`: the fine-tuning module for that data, tokens/s logging, export.
"""

from slidedp_lightning.recipes.synthetic import SyntheticTaskDataset, TaskSpec, answer_accuracy

__all__ = ["SyntheticTaskDataset", "TaskSpec", "answer_accuracy"]
