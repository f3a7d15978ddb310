import gc
import sys

from slidedp_lightning.hf.export_cli import main

code = main()
gc.freeze()  # exit without collecting the heap again (see slidedp_lightning_cli.finetune.cli)
sys.exit(code)
