"""The command line of slidedp-lightning, kept out of the package :mod:`slidedp_lightning`.

``import slidedp_lightning`` registers ``strategy="slidedp"`` with Lightning's Trainer and Fabric, which imports
Lightning and torch (seconds); every module of that package runs it first. The modules here import neither, nor
transformers, so that ``slidedp-finetune --help`` and a refused flag answer at once; the job imports the library
only once its flags are checked.

* :mod:`slidedp_lightning_cli.finetune`: ``slidedp-finetune``'s flags, their checks and :func:`~.finetune.main`;
  the run itself is :mod:`slidedp_lightning.recipes.job`.
* :mod:`slidedp_lightning_cli.task`: the synthetic task's shape and token ids (its data in
  :mod:`slidedp_lightning.recipes.synthetic`).
"""
