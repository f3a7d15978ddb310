import sys

from slidedp_lightning.hf.export_cli import main

sys.exit(main())
