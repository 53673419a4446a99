"""The label columns of a classification dataset, checked before anything is tokenized: one kind of
label, at least two classes in training, every eval label among them. Each problem is one line
naming ``data.label_column``, its value and the offending labels."""

from __future__ import annotations

from effitrain.config.errors import invalid


def _shown(values) -> str:
    values = sorted(values, key=str)
    return ", ".join(repr(v) for v in values[:5]) + (", ..." if len(values) > 5 else "")


def check_label_kinds(column: str, every: set) -> None:
    """Labels of one kind: in a numeric column whole class ids only (1.5 would become a class of
    its own), and no class ids mixed with names ("1" beside "x").

    Raises:
        ConfigError: naming the column and the offending values.
    """
    key = "data.label_column"
    numeric = [v for v in every if isinstance(v, (int, float)) and not isinstance(v, bool)]
    fractional = [v for v in numeric if isinstance(v, float) and not float(v).is_integer()]
    if fractional:
        raise invalid(
            key, column, f"a numeric label column must hold whole class ids; it holds {_shown(fractional)}"
        )
    numbers_as_text = [v for v in every if isinstance(v, str) and v.strip().lstrip("-").isdigit()]
    if numbers_as_text and len(numbers_as_text) < len(every):
        others = [v for v in every if v not in numbers_as_text]
        raise invalid(key, column, f"the column mixes class ids ({_shown(numbers_as_text)}) with other values "
                                   f"({_shown(others)}): give ids or names, not both")  # fmt: skip


def check_label_sets(column, train: list, eval_: list, key: str = "data.label_column") -> None:
    """At least two classes in training, and every eval label among them (a class never trained on
    scores as a guaranteed error, and disjoint sets mean the splits were labelled differently).
    ``key``/``column``: the key and value a problem names (the label column, or for data made in
    code the size that left a class out).

    Raises:
        ConfigError: naming the key and the offending values.
    """
    train_values, eval_values = set(train), set(eval_)
    if len(train_values) < 2:
        raise invalid(key, column, f"the train split holds a single class ({_shown(train_values)}): "
                                   "classification needs at least 2")  # fmt: skip
    unseen = eval_values - train_values
    if unseen:
        raise invalid(key, column, f"the eval split holds labels the train split lacks ({_shown(unseen)}; "
                                   f"train has {_shown(train_values)})")  # fmt: skip


def input_blind_loss(train_labels, eval_labels, num_classes: int) -> float | None:
    """The eval cross-entropy of a classifier that ignores the text: it predicts the training labels'
    class prior, or the uniform distribution where that scores better (an untrained head predicts
    about uniformly, and beats a prior the eval split does not share). A run whose eval loss is not
    below it learned nothing measurable. None without labels."""
    import math
    from collections import Counter

    train, evaluated = Counter(train_labels), Counter(eval_labels)
    if not train or not evaluated or num_classes < 1:
        return None
    uniform = math.log(num_classes)
    if any(label not in train for label in evaluated):  # the prior's loss is infinite there
        return uniform
    total_train, total_eval = sum(train.values()), sum(evaluated.values())
    prior = -sum(n / total_eval * math.log(train[label] / total_train) for label, n in evaluated.items())
    return min(prior, uniform)
