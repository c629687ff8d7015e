"""Self-healing AMP (``config.enable_amp_autofix``): pin to fp32 what keeps overflowing.

The runtime hands each analysed overflow (``records.probes.OverflowEvent``) to ``Autofix.consider``.
An event names what would have prevented it (``event.pins``: the low-precision op that produced
the first non-finite value, or the ops that asked for an overflowing cast); events with nothing
to pin (a data fault, an op already in fp32, a gradient overflow the loss scale explains) are
only counted by the report. When the same fix is named by ``after`` overflowing steps, it is
made:

- the op itself first (the narrowest pin);
- the op's whole module if an op of that module was pinned before and the module still
  overflows (the op pin was not sufficient);
- never more than ``max_pins`` pins (module pins replace the op pins they cover); past that,
  one warning per fix, nothing pinned.

Each pin is one log line (INFO, or WARNING when graphamp's logger does not show INFO: a pin is
never silent). Pins live in ``config.amp_pins``, so the next call rebuilds the step.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..records.pins import AmpPin
from ..records.probes import OverflowEvent
from ..records.settings import AutofixSettings
from ..records.validate import check_int

if TYPE_CHECKING:  # the Graph's config, handed in: autofix pins through its setters
    from ..config import GraphConfig

log = logging.getLogger("graphamp")


class Autofix:
    """The host-side counting and pinning of one Graph."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[AmpPin, ...]] = Counter()
        self._warned: set[tuple[AmpPin, ...]] = set()

    def state_dict(self) -> list[dict]:
        """The partial counts (fixes named by fewer than ``after`` overflowing steps so far), in
        plain values: a resumed run pins at the same step as an uninterrupted one."""
        return [
            {"pins": [pin.to_dict() for pin in pins], "count": count}
            for pins, count in self.counts.items()
        ]

    @staticmethod
    def check_state_dict(saved: Any) -> Counter[tuple[AmpPin, ...]]:
        """The counts ``state_dict`` saved; ConfigError if they do not load."""
        if not isinstance(saved, (list, tuple)):
            raise ConfigError(
                f"the saved autofix counts must be a list, got {type(saved).__name__}"
            )
        counts: Counter[tuple[AmpPin, ...]] = Counter()
        try:
            for entry in saved:
                pins = tuple(AmpPin.from_dict(d) for d in entry["pins"])
                counts[pins] = check_int("a saved autofix count", entry["count"], at_least=1)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(
                f"the saved autofix counts do not load: {type(e).__name__}: {e}"
            ) from e
        return counts

    def load_counts(self, counts: Counter[tuple[AmpPin, ...]]) -> None:
        """Replace the counts with checked saved ones (``check_state_dict``)."""
        self.counts = Counter(counts)

    def consider(
        self, graph: str, events: list[OverflowEvent], config: GraphConfig
    ) -> list[AmpPin]:
        """Count ``events`` (from a step built with the current pins); pin what reached the
        threshold. Returns the pins made: after a pin the rest of ``events`` came from a step
        built without it, so they are not counted."""
        settings = config.autofix
        if settings is None:
            return []
        for event in events:
            if not event.pins:
                continue
            self.counts[event.pins] += 1
            if self.counts[event.pins] >= settings.after:
                made = self._pin(graph, event, settings, config)
                if made:
                    return made
        return []

    def _pin(
        self, graph: str, event: OverflowEvent, settings: AutofixSettings, config: GraphConfig
    ) -> list[AmpPin]:
        if config.amp_opt_level == "O3":
            self._warn_once(
                event.pins,
                "%s: autofix cannot pin %s: opt level O3 runs every op in "
                "low precision, pins included",
                graph,
                _names(event.pins),
            )
            return []
        reason = (
            f"autofix: the first non-finite value on {self.counts[event.pins]} skipped "
            f"steps, the last at step {event.step}"
            + (f" ({event.location})" if event.location else "")
        )
        new, replaced = _choose(event.pins, config.amp_pins, reason, event.step)
        ours = [p for p in config.amp_pins if p.step is not None and p not in replaced]
        if len(ours) + len(new) > settings.max_pins:
            self._warn_once(
                event.pins,
                "%s: autofix would pin %s to fp32 but already made "
                "max_pins=%d pins; raise max_pins or pin it yourself "
                "(config.pin_fp32)",
                graph,
                _names(new),
                settings.max_pins,
            )
            return []
        if replaced:
            config.clear_amp_pins(*replaced)
        config.pin_fp32(*new)
        del self.counts[event.pins]
        level = logging.INFO if log.isEnabledFor(logging.INFO) else logging.WARNING
        for pin in new:
            log.log(
                level,
                "%s: autofix pinned %s to fp32 (%s%s); the step is rebuilt at the "
                "next call. g.config.amp_pins lists pins, g.config.clear_amp_pins() removes "
                "them",
                graph,
                pin.describe(),
                reason,
                f"; replaces the op pins {_names(replaced)}" if replaced else "",
            )
        return new

    def _warn_once(self, key: tuple[AmpPin, ...], msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)


def _choose(
    wanted: tuple[AmpPin, ...], existing: tuple[AmpPin, ...], reason: str, step: int
) -> tuple[list[AmpPin], list[AmpPin]]:
    """(pins to add, autofix op pins they replace): each wanted op, or its module when an op
    of that module was pinned before and it overflows again."""
    new: list[AmpPin] = []
    replaced: list[AmpPin] = []
    for pin in wanted:
        earlier = [
            p
            for p in existing
            if p.step is not None and p.op is not None and p.module == pin.module
        ]
        if earlier and pin.module:
            chosen = AmpPin(pin.module, None, 0, reason, step)
            replaced += [p for p in earlier if p not in replaced]
        else:
            chosen = AmpPin(pin.module, pin.op, pin.index, reason, step)
        if chosen not in new and chosen not in existing:
            new.append(chosen)
    return new, replaced


def _names(pins) -> str:
    return ", ".join(p.describe() for p in pins)
