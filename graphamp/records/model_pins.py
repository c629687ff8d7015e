"""fp32 pins a model declares about itself: transformers' ``_keep_in_fp32_modules``.

A transformers model names the parts that lose accuracy in fp16 (T5's feed-forward output
projection ``wo``, a router's correction bias, ...). transformers only uses these lists when it
loads weights in half precision; the same parts are the ones AMP must keep in fp32, so graphamp
reads them as pins, with the same reach transformers gives them:

- ``_keep_in_fp32_modules`` applies when the low-precision dtype is fp16,
  ``_keep_in_fp32_modules_strict`` when it is fp16 or bf16;
- each entry is a regular expression (``*`` meaning ``.*``) *searched* in a name relative to
  the model that declares it, as transformers searches it in each parameter's key;
- only the outermost transformers model counts (its ``post_init`` gathers its sub-models'
  lists), as only the model ``from_pretrained`` loads counts there.

A module is pinned when its own name or the key of one of its own parameters or buffers
matches. The user turns a model's pins off the way transformers does: by setting the attribute
to ``None`` on the model registered with the Graph (``model._keep_in_fp32_modules = None``);
graphamp sees that at the next call.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch
import torch.nn as nn

DECLARATIONS = {  # attribute -> the low-precision dtypes under which it pins
    "_keep_in_fp32_modules": (torch.float16,),
    "_keep_in_fp32_modules_strict": (torch.float16, torch.bfloat16),
}


def declared_patterns(module: nn.Module) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(attribute, entries) for each non-empty fp32 declaration of ``module``."""
    found = []
    for attribute in DECLARATIONS:
        entries = getattr(module, attribute, None)
        if entries:
            found.append((attribute, tuple(sorted(entries))))
    return tuple(found)


def model_fp32_pins(root: nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """Module path (from ``root``) -> why it is pinned, for every declaration that applies."""
    pins: dict[str, str] = {}
    for owner_path, owner in declaring_models(root):
        for attribute, entries in declared_patterns(owner):
            if dtype not in DECLARATIONS[attribute]:
                continue
            for entry in entries:
                pattern = re.compile(entry.replace("*", ".*"))
                for path in _matching_modules(owner, pattern):
                    full = ".".join(p for p in (owner_path, path) if p)
                    pins.setdefault(full, f"pinned fp32 by the model's {attribute} ({entry!r})")
    return pins


def declaring_models(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules that carry a declaration attribute (set or None)."""
    found: list[tuple[str, nn.Module]] = []
    for path, module in root.named_modules():
        inside = any(path.startswith(p + ".") or not p for p, _ in found)
        if not inside and any(hasattr(module, a) for a in DECLARATIONS):
            found.append((path, module))
    return found


def _matching_modules(owner: nn.Module, pattern: re.Pattern) -> Iterator[str]:
    for path, module in owner.named_modules():
        if not path:
            continue
        keys = [f"{path}.{name}" for name, _ in module.named_parameters(recurse=False)]
        keys += [f"{path}.{name}" for name, _ in module.named_buffers(recurse=False)]
        if pattern.search(path) or any(pattern.search(k) for k in keys):
            yield path
