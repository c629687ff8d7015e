"""One graph input from an optimizer step's micro-batches (the Trainer integration).

The transformers Trainer hands its training step one micro-batch at a time; graphamp runs an
optimizer step's micro-batches as equal slices along dim 0 of one batch
(``config.set_gradient_accumulation_steps``). So the micro-batches are concatenated. A padding
collator (``DataCollatorWithPadding``) pads each micro-batch to its own longest sequence; those
are padded again, on the right, to the step's longest, with the values the collators use, so
the padded positions stay masked and unlabelled and the loss is unchanged. An epoch's last
micro-batch, when it is smaller, is grown to the others' size with rows that carry no loss
(copies of its first row, every label ``IGNORE_INDEX``), so the step keeps equal slices and its
compiled program; the loss is unchanged where each row's loss depends on that row alone (not
with BatchNorm, or a mixture-of-experts balancing loss over the whole batch).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from ..errors import InputError

IGNORE_INDEX = -100  # transformers' label for "no loss here" (its collators pad labels with it)


def pad_values(pad_token_id: int | None, pad_token_type_id: int = 0) -> dict[str, int | None]:
    """What each field transformers' collators pad is padded with."""
    return {
        "input_ids": pad_token_id,
        "attention_mask": 0,
        "token_type_ids": pad_token_type_id,
        "special_tokens_mask": 1,
        "labels": IGNORE_INDEX,
    }


def combine(
    batches: list[Mapping[str, Any]], pads: dict[str, int | None], padding_side: str = "right"
) -> dict[str, Any]:
    """The micro-batches as one batch: tensors concatenated along dim 0 (a smaller last
    micro-batch grown first, sequence dimensions padded to the longest), other values kept
    (they must agree)."""
    keys = list(batches[0])
    for b in batches[1:]:
        if list(b) != keys:
            raise InputError(
                f"graphamp's Trainer: the micro-batches of one optimizer step have different "
                f"fields ({keys} and {list(b)}); the collator must give every batch the same ones"
            )
    batches = _equal_rows(batches)
    out = {}
    for key in keys:
        values = [b[key] for b in batches]
        if isinstance(values[0], torch.Tensor):
            out[key] = torch.cat(_same_shape(key, values, pads, padding_side), dim=0)
        elif any(v != values[0] for v in values[1:]):
            raise InputError(
                f"graphamp's Trainer: field {key!r} differs between the micro-batches of one "
                f"optimizer step ({values!r}); graphamp runs them as one batch"
            )
        else:
            out[key] = values[0]
    return out


def _rows(batch: Mapping[str, Any]) -> int | None:
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _equal_rows(batches: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Micro-batches of one size: a smaller one (an epoch's last batch) grown with rows that
    carry no loss. Its labels say which rows count (``IGNORE_INDEX``: transformers' "no loss
    here", which its losses skip in the sum and the mean alike); without integer ``labels``
    there is no such row, and the step is refused."""
    found = [_rows(b) for b in batches]
    sizes = [n for n in found if n is not None]
    if len(sizes) < len(found) or len(set(sizes)) == 1:
        return batches  # equal already, or rows that disagree: _same_shape says which field
    labels = batches[0].get("labels")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point():
        raise InputError(
            f"graphamp's Trainer: the micro-batches of one optimizer step have {sorted(set(sizes))} "
            "rows and graphamp cannot grow the smaller one with rows that carry no loss (that "
            "needs integer 'labels', where -100 means no loss). Set dataloader_drop_last=True, "
            "or make the dataset a multiple of the batch size"
        )
    full = max(sizes)
    return [b if n == full else _grown(b, n, full) for b, n in zip(batches, sizes)]


def _grown(batch: Mapping[str, Any], rows: int, full: int) -> dict[str, Any]:
    out = dict(batch)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            extra = value[:1].expand(full - rows, *value.shape[1:])
            if key == "labels":
                extra = torch.full_like(extra, IGNORE_INDEX)
            out[key] = torch.cat([value, extra], dim=0)
    return out


def _same_shape(
    key: str, values: list[torch.Tensor], pads: dict[str, int | None], side: str
) -> list[torch.Tensor]:
    shapes = {tuple(v.shape) for v in values}
    if len(shapes) == 1:
        return values
    if len({v.dim() for v in values}) != 1 or len({v.shape[0] for v in values}) != 1:
        raise InputError(
            f"graphamp's Trainer: field {key!r} has shapes {sorted(shapes)} in the micro-batches "
            "of one optimizer step; graphamp needs micro-batches of one size (set "
            "dataloader_drop_last=True so that the last batch is not smaller)"
        )
    value = pads.get(key)
    if value is None or side != "right":
        raise InputError(
            f"graphamp's Trainer: field {key!r} has shapes {sorted(shapes)} in the micro-batches "
            f"of one optimizer step and graphamp cannot pad it to one length ("
            + (
                "padding on the left would move the tokens' positions"
                if value is not None
                else "it does not know the padding value of this field"
            )
            + "). Pad every batch to one length (the tokenizer's padding='max_length'), or use "
            "gradient_accumulation_steps=1"
        )
    longest = [max(v.shape[d] for v in values) for d in range(values[0].dim())]
    return [_pad_right(v, longest, value) for v in values]


def _pad_right(t: torch.Tensor, shape: list[int], value: int) -> torch.Tensor:
    widths: list[int] = []
    for d in reversed(range(1, t.dim())):  # F.pad lists the last dimension first
        widths += [0, shape[d] - t.shape[d]]
    return F.pad(t, widths, value=value) if any(widths) else t


def per_row(num_items: Any, rows: int, device: torch.device) -> torch.Tensor | None:
    """The Trainer's ``num_items_in_batch`` (the step's label count, or None) as one value per
    row: graphamp slices every input along dim 0, so a step-wide number travels per row."""
    if num_items is None:
        return None
    return torch.as_tensor(num_items, device=device).reshape(()).expand(rows).contiguous()
