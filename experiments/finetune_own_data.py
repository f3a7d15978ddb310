"""Fine-tune on your own JSONL data, fully offline: ``python experiments/finetune_own_data.py [--workdir DIR]``.

Generates everything it needs under ``--workdir``:

1. a byte-level BPE tokenizer trained with ``tokenizers`` on generated text, wrapped as a transformers
   ``PreTrainedTokenizerFast`` with a ChatML-style chat template;
2. a tiny random Qwen3 (``slidedp_lightning/recipes/configs/qwen3_tiny.json`` with that vocabulary) saved with
   ``save_pretrained`` next to the tokenizer;
3. a letter-reversal task as ``train.jsonl`` (prompt/completion records and, one in four, the same task as chat
   ``messages``) and ``val.jsonl``;

then runs ``slidedp-finetune --model ... --data ... --export ...`` (``experiments/finetune.py``, 2 CPU ranks), reloads
the export with transformers, recomputes its validation loss and greedily generates answers with ``model.generate``
before and after training.  Prints a summary and writes it as JSON to ``WORKDIR/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from importlib import resources

import torch

LETTERS = "abcdefghijklmnop"
LENGTH = 5
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FINETUNE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "finetune.py")


def example(rng: random.Random) -> tuple[str, str]:
    """One task example: ``("reverse a b c d e =", " e d c b a")``."""
    word = [rng.choice(LETTERS) for _ in range(LENGTH)]
    return "reverse " + " ".join(word) + " =", " " + " ".join(reversed(word))


def build_tokenizer(out: str, rng: random.Random):
    """Train a byte-level BPE on generated text, wrap it with a chat template, save it to ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = [" ".join(example(rng)) for _ in range(2000)]
    text += ["user assistant system the model answers " + " ".join(rng.sample(LETTERS, 8)) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    wrapped.save_pretrained(out)
    return wrapped


def build_model(out: str, tokenizer, seed: int) -> None:
    """A tiny random Qwen3 with the tokenizer's vocabulary, saved to ``out``."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    data = json.loads(resources.files("slidedp_lightning.recipes").joinpath("configs", "qwen3_tiny.json").read_text())
    attn = data.pop("attn_implementation", "sdpa")
    data.update(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3Config.from_dict(data), attn_implementation=attn)
    model.save_pretrained(out)


def write_data(path: str, n: int, rng: random.Random, chat_every: int = 0) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            prompt, completion = example(rng)
            if chat_every and i % chat_every == 0:
                record: dict = {
                    "messages": [
                        {"role": "user", "content": prompt},
                        {"role": "assistant", "content": completion.strip()},
                    ]
                }
            else:
                record = {"prompt": prompt, "completion": completion}
            f.write(json.dumps(record) + "\n")


def generate_accuracy(model_dir: str, val_path: str, n: int) -> tuple[float, list[str]]:
    """Greedy ``model.generate`` on the first ``n`` validation prompts: fraction answered exactly, a few answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with open(val_path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f][:n]
    prompts = torch.tensor([tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in records])
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=2 * LENGTH + 2,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            use_cache=True,
        )
    answers = tok.batch_decode(out[:, prompts.shape[1] :], skip_special_tokens=True)
    right = sum(a.strip() == r["completion"].strip() for a, r in zip(answers, records, strict=True))
    shown = [f"{r['prompt']!r} -> {a.strip()!r}" for a, r in list(zip(answers, records, strict=True))[:3]]
    return right / len(records), shown


def export_val_loss(model_dir: str, val_path: str, seq_len: int) -> float:
    """Validation loss of a saved model, in FP32, with the recipe's tokenization and mask."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slidedp_lightning.recipes.data import JsonlDataset
    from slidedp_lightning.recipes.own_data import metrics_from_sums, sum_metrics

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    data = JsonlDataset(val_path, tok, seq_len)
    sums = torch.zeros(5, dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, len(data), 64):
            ids, mask, labels = (t[i : i + 64] for t in (data.input_ids, data.attention_mask, data.labels))
            sums += sum_metrics(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, labels)
    return metrics_from_sums(sums)["val_loss"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default=os.path.join("runs", "own_data"))
    p.add_argument("--strategy", default="slidedp", choices=("slidedp", "ddp"))
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--train-size", type=int, default=4096)
    p.add_argument("--val-size", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--generate", type=int, default=64, help="validation prompts answered with model.generate")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed for the fine-tune command")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    work = os.path.abspath(args.workdir)
    model_dir, export_dir = os.path.join(work, "model"), os.path.join(work, "export")
    os.makedirs(model_dir, exist_ok=True)
    rng = random.Random(args.seed)
    tokenizer = build_tokenizer(model_dir, rng)
    build_model(model_dir, tokenizer, args.seed)
    train, val = os.path.join(work, "train.jsonl"), os.path.join(work, "val.jsonl")
    write_data(train, args.train_size, rng, chat_every=4)
    write_data(val, args.val_size, rng)

    before_acc, before_answers = generate_accuracy(model_dir, val, args.generate)
    results = os.path.join(work, "results.json")
    # the formatter is told to skip this list: each flag and its value stay a pair, as typed on a command line
    cmd = [
        sys.executable, FINETUNE, "--model", model_dir, "--data", train, "--val-data", val,
        "--seq-len", str(args.seq_len), "--export", export_dir, "--precision", "32-true",
        "--strategy", args.strategy, "--devices", str(args.devices), "--max-steps", str(args.max_steps),
        "--batch-size", "32", "--lr", "3e-3", "--results", results, "--log-dir", os.path.join(work, "logs"),
    ]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, timeout=args.timeout)
    elapsed = time.perf_counter() - t0
    with open(results) as f:
        metrics = json.load(f)
    after_acc, after_answers = generate_accuracy(export_dir, val, args.generate)
    summary = {
        "val_loss_before": metrics["before"]["val_loss"],
        "val_loss_after": metrics["after"]["val_loss"],
        "val_acc_before": metrics["before"]["val_acc"],
        "val_acc_after": metrics["after"]["val_acc"],
        "export_val_loss": export_val_loss(export_dir, val, args.seq_len),
        "generate_acc_before": before_acc,
        "generate_acc_after": after_acc,
        "finetune_seconds": elapsed,
        "export_dir": export_dir,
    }
    print("generated before:", *before_answers, sep="\n  ")
    print("generated after: ", *after_answers, sep="\n  ")
    print(json.dumps(summary, indent=2))
    with open(os.path.join(work, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
