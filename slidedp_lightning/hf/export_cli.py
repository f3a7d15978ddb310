"""``python -m slidedp_lightning.export CHECKPOINT_DIR OUT_DIR``: a distributed checkpoint as a Hugging Face
``save_pretrained`` directory (see :func:`slidedp_lightning.hf.export.export_checkpoint`); the command's name is
the package :mod:`slidedp_lightning.export`, whose ``__main__`` calls :func:`main`."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from slidedp_lightning.hf.export import DTYPES, ExportStopped, export_checkpoint


class _Terminated(BaseException):
    """SIGTERM while exporting: raised where the export is, so that it removes what it wrote (as on Ctrl-C)."""


_STOP = threading.Event()  # also set: a handler's exception raised inside a finalizer is lost, the event is not
_RECEIVED: list[int] = []


def _terminate(signum: int, frame: object) -> None:
    _RECEIVED.append(signum)
    _STOP.set()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
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
    previous = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGINT)} if installed else {}
    _STOP.clear()
    _RECEIVED.clear()
    try:
        export_checkpoint(
            args.checkpoint, args.out, args.dtype, args.max_shard_size, args.config, args.adapter_only, stop=_STOP
        )
    except (OSError, ValueError, KeyError, TypeError, NotImplementedError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, _Terminated, ExportStopped):
        signum = _RECEIVED[0] if _RECEIVED else signal.SIGINT  # a KeyboardInterrupt raised by other means: SIGINT
        name = signal.Signals(signum).name
        print(
            f"{parser.prog}: interrupted by {name}: {args.out} is unchanged, nothing of the export left",
            file=sys.stderr,
        )
        return 128 + signum
    finally:
        for signum_, handler in previous.items():
            signal.signal(signum_, handler)
    return 0
