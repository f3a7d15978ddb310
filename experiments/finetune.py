"""Fine-tuning job: ``python experiments/finetune.py [--strategy ddp] [--help]``.

Thin wrapper around :func:`slidedp_lightning_cli.finetune.cli` (also
installed as the ``slidedp-finetune`` command).
"""

from slidedp_lightning_cli.finetune import cli

if __name__ == "__main__":
    cli()
