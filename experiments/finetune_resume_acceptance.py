"""The fine-tuning job at a real size, killed and resumed: ``python experiments/finetune_resume_acceptance.py
--workdir DIR``.

Writes a random Qwen3-shaped checkpoint of about 0.21 B parameters (14 blocks of 1024 wide, a 32 k vocabulary,
untied head) with the letter-reversal tokenizer and data of ``experiments/finetune_own_data.py``, then runs on 2
CPU ranks::

    slidedp-finetune --model D --data train.jsonl --pack --optimizer-state int8 --activation-policy full
        --accumulate-grad-batches 2 --checkpoint-dir C --checkpoint-every 5 --max-steps 12 --export OUT
        --precision 32-true --val-split 0.05 --val-every 12   (or --precision bf16-mixed)

once through, and once killed with SIGKILL (launcher and ranks) as soon as its second checkpoint is complete, then
rerun with ``--resume auto``. Checks that both exports hold the same weights bit for bit and that transformers
reloads them; prints the times and each run's peak host memory (the job's proportional set size, sampled: private
memory and the ledger's shared pages, each counted once), and writes them to ``DIR/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from slidedp_lightning.recipes.host_memory import process_tree, pss_bytes

HERE = Path(__file__).resolve().parent
CLI = Path(sys.executable).with_name("slidedp-finetune")


def build(workdir: Path, seed: int = 0) -> int:
    """The checkpoint, tokenizer and data; returns the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    sys.path.insert(0, str(HERE))
    from finetune_own_data import build_tokenizer, write_data

    rng = random.Random(seed)
    base = workdir / "base"
    tokenizer = build_tokenizer(str(base), rng)
    config = Qwen3Config(
        vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=14, num_attention_heads=16,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(base)
    write_data(str(workdir / "train.jsonl"), 512, rng, chat_every=4)
    return sum(p.numel() for p in model.parameters())


def job(workdir: Path, name: str, extra: list[str] = (), precision: str = "32-true") -> list[str]:
    return [
        str(CLI), "--model", str(workdir / "base"), "--data", str(workdir / "train.jsonl"), "--pack",
        "--seq-len", "64", "--batch-size", "2", "--optimizer-state", "int8", "--activation-policy", "full",
        "--accumulate-grad-batches", "2", "--checkpoint-dir", str(workdir / f"ck-{name}"), "--checkpoint-every", "5",
        "--max-steps", "12", "--export", str(workdir / f"out-{name}"), "--precision", precision, "--lr", "1e-4",
        "--val-split", "0.05", "--val-every", "12",
        "--results", str(workdir / f"{name}.json"), "--log-dir", str(workdir / f"logs-{name}"), *extra,
    ]  # fmt: skip


def run(cmd: list[str], log: Path, kill_when: Path | None = None) -> tuple[int, float, int]:
    """(exit status, seconds, peak PSS of the job's process tree); SIGKILL the tree once ``kill_when`` exists."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, sum(pss_bytes(pid) for pid in process_tree(proc.pid)))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    while proc.poll() is None:
        if kill_when is not None and kill_when.exists():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.05)
    done.set()
    sampler.join()
    return proc.returncode, time.perf_counter() - t0, peak


def weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("runs/finetune_resume_acceptance"))
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    args = p.parse_args()
    work: Path = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    params = build(work)
    print(f"checkpoint: {params / 1e9:.3f} B parameters", flush=True)

    whole = run(job(work, "whole", precision=args.precision), work / "whole.log")
    assert whole[0] == 0, (work / "whole.log").read_text()[-3000:]
    killed = run(job(work, "resumed", precision=args.precision), work / "killed.log",
                 kill_when=work / "ck-resumed" / "step=10.ckpt")  # fmt: skip
    assert not (work / "out-resumed").exists(), "the killed run finished before its second checkpoint"
    resumed = run(job(work, "resumed", ["--resume", "auto"], args.precision), work / "resumed.log")
    assert resumed[0] == 0, (work / "resumed.log").read_text()[-3000:]

    import torch
    from transformers import AutoModelForCausalLM

    want, got = weights(work / "out-whole"), weights(work / "out-resumed")
    different = sorted(n for n in want if not torch.equal(want[n], got[n]))
    AutoModelForCausalLM.from_pretrained(work / "out-resumed")  # transformers reloads the export
    report = json.loads((work / "whole.json").read_text())
    largest = max((want[n].double() - got[n].double()).abs().max().item() for n in want) if want else float("nan")
    summary = {
        "params": params,
        "precision": args.precision,
        "largest_difference": largest,
        "bit_identical": not different and sorted(want) == sorted(got),
        "different": different,
        "seconds": {"whole": whole[1], "killed": killed[1], "resumed": resumed[1]},
        "peak_pss_bytes": {"whole": whole[2], "killed": killed[2], "resumed": resumed[2]},
        "whole_report": report,
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "whole_report"}, indent=1))
    print(
        f"tokens/s {report['tokens_per_s']:.0f}, step {report['step_s']:.2f} s, pack_factor {report['pack_factor']:.2f}"
    )
    return 0 if summary["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
