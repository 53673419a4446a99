"""Load an exported model folder with plain transformers (no effitrain import) and recompute a loss.

    python plain_load.py OUT AUTO_CLASS BATCHES.pt TEXT

``BATCHES.pt``: the run's eval batches (dicts of tensors, ``labels`` among them), read with
``weights_only=True``. Prints JSON: the loss over every target (a classifier's samples, a causal LM's
shifted tokens) by transformers' own loss, the tokenizer's ids of TEXT, and the effitrain modules
imported (none). Run as a subprocess by tests/commands/test_export.py."""

import json
import sys

import torch
import transformers

out, auto_class, batches, text = sys.argv[1:5]
model = getattr(transformers, auto_class).from_pretrained(out).eval()
tokenizer = transformers.AutoTokenizer.from_pretrained(out)
total, count = 0.0, 0
with torch.no_grad():
    for batch in torch.load(batches, weights_only=True):
        labels = batch.pop("labels")
        # transformers' loss is the mean over the batch's targets: weighed back into a sum
        n = (
            len(labels)
            if auto_class.endswith("SequenceClassification")
            else int((labels[:, 1:] != -100).sum())
        )
        total += model(**batch, labels=labels).loss.double().item() * n
        count += n
print(
    json.dumps(
        {
            "loss": total / count,
            "ids": tokenizer(text)["input_ids"],
            "effitrain_modules": sorted(name for name in sys.modules if name.split(".")[0] == "effitrain"),
        }
    )
)
