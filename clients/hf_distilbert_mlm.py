"""transformers examples/pytorch/language-modeling/run_mlm_no_trainer.py: masked-LM training of
DistilBertForMaskedLM with the library's DataCollatorForLanguageModeling (15% of the non-special
tokens picked by ``torch.bernoulli``; of those 80% -> [MASK], 10% -> a random token, 10% kept;
labels -100 elsewhere) run by the DataLoader between steps, AdamW over the script's two parameter
groups (``no_decay = ["bias", "LayerNorm.weight"]``), ``get_scheduler("linear")``, and the
script's (pre-``accelerator.accumulate``) gradient accumulation: ``loss = loss /
args.gradient_accumulation_steps``, backward every batch, and ``optimizer.step();
lr_scheduler.step(); optimizer.zero_grad()`` (``completed_steps += 1``) only when
``step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1``. The
per-epoch evaluation (model.eval(), no_grad forward on collated -- so also randomly masked --
eval batches, ``loss.repeat(per_device_eval_batch_size)``, perplexity of the mean).

How accumulation maps onto the step: the step is the script's per-batch body (forward, scaled
loss, backward, and the conditional optimizer/scheduler update), called once per batch with the
batch index ``step``; with --gradient_accumulation_steps 2 and 4 batches an epoch, the update runs
at batches 0, 2 and 3 (the script's ``step % 2 == 0`` condition updates after the first batch
alone, then every second, and at the epoch's last), the others only add into ``.grad``: the step
takes two paths (with and without the update).

Model: the installed transformers' DistilBertForMaskedLM (not vendored), built with
``AutoModelForMaskedLM.from_config`` (the script's from-scratch path) from DistilBertConfig
defaults except vocab_size=len(tokenizer) (100), dim=32, n_layers=2, n_heads=2, hidden_dim=64,
max_position_embeddings=64 (default attention implementation, dropout 0.1, vocab projector tied to
the word embeddings); ``model.resize_token_embeddings(len(tokenizer))`` as this version of the
script calls it. Loop: run_mlm_no_trainer.py as the hasansalimkanmaz/transformers fork holds it
at 7511de6 (the upstream script of the transformers 4.1x era, before ``accelerator.accumulate``),
without accelerate: ``accelerator.backward(loss)`` is ``loss.backward()``,
``accelerator.gather`` the identity. ``transformers.AdamW`` (gone in transformers 5) is
``torch.optim.AdamW`` (its eps 1e-8 where transformers' was 1e-6).

Tokenizer and data: there is no hub access here, so ``AutoTokenizer.from_pretrained`` is replaced
by the library's DistilBertTokenizer built offline from an in-memory WordPiece vocabulary
([PAD] [UNK] [CLS] [SEP] [MASK] + 95 words); masking is the library's own collator, not a
re-implementation. Synthetic texts of random words go through the script's default
(non-line-by-line) path: ``tokenizer(texts, return_special_tokens_mask=True)``, then
``group_texts`` concatenates and cuts them into max_seq_length chunks. Scaled down: max_seq_length
16, 16 train / 4 eval chunks, batch 4, --gradient_accumulation_steps 2, --weight_decay 0.01,
learning_rate 5e-5, num_warmup_steps 0, --max_train_steps ``steps`` (the loop is cut after
``steps`` calls of the step).

Restated after the source, not copied.
"""
import math
from itertools import chain

import torch
from torch.utils.data import DataLoader
from transformers import (AutoModelForMaskedLM, DataCollatorForLanguageModeling, DistilBertConfig,
                          DistilBertTokenizer, get_scheduler)

SOURCE = ("https://github.com/hasansalimkanmaz/transformers/blob/7511de6b7018859aa0e8473fce67a0e31e1ae109/"
          "examples/pytorch/language-modeling/run_mlm_no_trainer.py")
LICENSE = "Apache-2.0"
TAGS = ("transformer", "hf", "distilbert", "mlm", "grad-accum", "conditional-step", "lr-scheduler", "adamw",
        "weight-decay-groups", "dict-batch", "dropout", "eval-mode", "python-counter", "tied-weights",
        "rng-outside-step")


class args:  # the script's argparse values, scaled down
    per_device_train_batch_size = 4
    per_device_eval_batch_size = 4
    learning_rate = 5e-5
    weight_decay = 0.01
    num_train_epochs = 3
    max_train_steps = None
    gradient_accumulation_steps = 2
    lr_scheduler_type = "linear"
    num_warmup_steps = 0
    max_seq_length = 16
    mlm_probability = 0.15


def offline_tokenizer(n_words=95):
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
    for i in range(n_words):
        vocab[f"w{i}"] = len(vocab)
    return DistilBertTokenizer(vocab=vocab)


def synthetic_texts(n, g, n_words=95):
    texts = []
    for _ in range(n):
        length = int(torch.randint(4, 14, (1,), generator=g))
        texts.append(" ".join(f"w{int(i)}" for i in torch.randint(0, n_words, (length,), generator=g)))
    return texts


def main(sg, steps=8, device="cpu", amp=None):
    device_type = device.split(":")[0]
    tokenizer = offline_tokenizer()
    config = DistilBertConfig(vocab_size=len(tokenizer), dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                              max_position_embeddings=64)
    model = AutoModelForMaskedLM.from_config(config)
    model.resize_token_embeddings(len(tokenizer))
    model.to(device)

    max_seq_length = min(args.max_seq_length, tokenizer.model_max_length)

    # The default path: tokenize every text, concatenate them, cut into max_seq_length chunks.
    def tokenize_function(texts):
        return tokenizer(texts, return_special_tokens_mask=True)

    def group_texts(examples):
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        total_length = (total_length // max_seq_length) * max_seq_length   # drop the remainder
        result = {
            k: [t[i: i + max_seq_length] for i in range(0, total_length, max_seq_length)]
            for k, t in concatenated_examples.items()
        }
        return result

    def as_dataset(grouped, n):
        return [{k: grouped[k][i] for k in grouped} for i in range(n)]

    g = torch.Generator().manual_seed(1)
    train_dataset = as_dataset(group_texts(dict(tokenize_function(synthetic_texts(40, g)))), 16)
    eval_dataset = as_dataset(group_texts(dict(tokenize_function(synthetic_texts(10, g)))), 4)

    # Data collator
    # This one will take care of randomly masking the tokens.
    data_collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=args.mlm_probability)

    # DataLoaders creation:
    train_dataloader = DataLoader(
        train_dataset, shuffle=True, collate_fn=data_collator, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(eval_dataset, collate_fn=data_collator, batch_size=args.per_device_eval_batch_size)

    # Optimizer
    # Split weights in two groups, one with weight decay and the other not.
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if all(nd not in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    # Scheduler and math around the number of training steps.
    args.max_train_steps = steps
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    else:
        args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.max_train_steps,
    )
    sg.track(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)

    completed_steps = 0

    @sg.compile
    def train_step(batch, step):
        nonlocal completed_steps
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp == "bf16"):
            outputs = model(**batch)
        loss = outputs.loss
        loss = loss / args.gradient_accumulation_steps
        loss.backward()
        if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            completed_steps += 1
        return loss

    calls = 0
    for epoch in range(args.num_train_epochs):
        if calls >= steps:
            break
        model.train()
        for step, batch in enumerate(train_dataloader):
            if calls >= steps:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = train_step(batch, step)
            calls += 1
            sg.log({"loss": loss, "completed_steps": completed_steps, "labels": batch["labels"]})

            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for step, batch in enumerate(eval_dataloader):
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.no_grad():
                with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp == "bf16"):
                    outputs = model(**batch)

            loss = outputs.loss
            losses.append(loss.repeat(args.per_device_eval_batch_size))

        losses = torch.cat(losses)
        losses = losses[: len(eval_dataset)]
        try:
            perplexity = math.exp(torch.mean(losses))
        except OverflowError:
            perplexity = float("inf")
        sg.log({"perplexity": perplexity})
