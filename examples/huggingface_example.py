"""Hugging Face Trainer with the forewarn callback: a tiny GPT-2 built from a config.

    python examples/huggingface_example.py --steps 20 --out /tmp/hf-run

Nothing is downloaded: the model is ``GPT2LMHeadModel(GPT2Config(...))`` with random
weights and the data are random token ids. :class:`ForewarnTrainerCallback` reports each
step to the node's forewarn agent; when the agent orders a checkpoint (or SIGTERM
arrives) it sets ``control.should_save`` so the Trainer's own save path writes
``checkpoint-<step>`` (model, optimizer, scheduler, RNG), and reports its cost.
"""

from __future__ import annotations

import argparse
import sys

import torch
import transformers

from forewarn.hook.huggingface import ForewarnTrainerCallback


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="hf-run")
    ap.add_argument("--job", default=None)
    ap.add_argument("--socket", default=None, help="agent socket (default $FOREWARN_SOCKET)")
    args = ap.parse_args(argv)
    transformers.set_seed(1234)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, config.vocab_size, (256, 32), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    callback = ForewarnTrainerCallback(job=args.job, socket_path=args.socket)
    targs = transformers.TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=8,
        logging_steps=1,  # the loss reaches forewarn's NaN / spike detectors every step
        save_strategy="no",  # only forewarn-ordered saves in this example
        report_to=[], disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
    )
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=data,
                                   callbacks=[callback])
    trainer.train()
    print(f"done: {trainer.state.global_step} steps, ordered checkpoints: {callback.saved_steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
