"""``python -m slidedp_lightning.export CHECKPOINT_DIR OUT_DIR``: a distributed checkpoint as a Hugging Face
``save_pretrained`` directory (see :func:`slidedp_lightning.hf.export.export_checkpoint`); the command's name is
the package :mod:`slidedp_lightning.export`, whose ``__main__`` calls :func:`main`."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from slidedp_lightning.hf.export import DTYPES, export_checkpoint


class _Terminated(BaseException):
    """SIGTERM while exporting: raised where the export is, so that it removes what it wrote (as on Ctrl-C)."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slidedp_lightning.export", description=export_checkpoint.__doc__)
    parser.add_argument("checkpoint", help="a SlideDP distributed checkpoint directory")
    parser.add_argument("out", help="the save_pretrained directory to write (replaced as a whole, atomically)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--config", help="Hugging Face model directory or config.json (if the checkpoint has none)")
    parser.add_argument(
        "--adapter-only", action="store_true", help="a peft (LoRA) checkpoint: write its adapters alone, peft's format"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    installed = threading.current_thread() is threading.main_thread()  # signal handlers: the main thread's only
    previous = signal.signal(signal.SIGTERM, _terminate) if installed else None
    try:
        export_checkpoint(args.checkpoint, args.out, args.dtype, args.max_shard_size, args.config, args.adapter_only)
    except (OSError, ValueError, KeyError, TypeError, NotImplementedError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, _Terminated) as err:
        signum = err.args[0] if isinstance(err, _Terminated) else signal.SIGINT
        name = signal.Signals(signum).name
        print(
            f"{parser.prog}: interrupted by {name}: {args.out} is unchanged, nothing of the export left",
            file=sys.stderr,
        )
        return 128 + signum
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous)
    return 0
