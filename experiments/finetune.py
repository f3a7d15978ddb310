"""Fine-tuning job: ``python experiments/finetune.py [--strategy ddp] [--help]``.

Thin wrapper around :func:`slidedp_lightning_cli.finetune.main` (also
installed as the ``slidedp-finetune`` command).
"""

import sys

from slidedp_lightning_cli.finetune import main

if __name__ == "__main__":
    sys.exit(main())
