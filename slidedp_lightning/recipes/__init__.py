"""Example recipes built on the slidedp strategy.

* :mod:`slidedp_lightning.recipes.synthetic`: a seed-deterministic synthetic
  sequence task (data set and answer-token accuracy).
* :mod:`slidedp_lightning.recipes.finetune`: the fine-tuning job
  (``slidedp-finetune`` command, ``experiments/finetune.py``).
"""

from slidedp_lightning.recipes.synthetic import SyntheticTaskDataset, TaskSpec, answer_accuracy

__all__ = ["SyntheticTaskDataset", "TaskSpec", "answer_accuracy"]
