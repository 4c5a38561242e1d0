"""What the DSN paper recipe's numbers support, in words (``python -m multidsn.train``'s report and
``--tune``'s): the paired differences with their 95% intervals, and the claims they do or do not carry."""

from __future__ import annotations

from .intervals import paired

BAR = 15.0
"""Points DSN-DANN must gain over source-only (the paper's MNIST -> MNIST-M gap is 26.6)."""


def selected_on_of(lines: list[dict]) -> str | None:
    marks = {r.get("selected_on") for r in lines}
    return marks.pop() if len(marks) == 1 else None


def verdict(acc: dict[str, dict[int, float]], selected_on: str | None) -> list[str]:
    """What the numbers support, in words: the paired DSN-DANN - source-only and DSN-DANN - DANN differences
    with their 95% intervals over the seeds both rows hold, never a bare "MET"."""
    gain = paired(acc["dsn_dann"], acc["source_only"])
    lead = paired(acc["dsn_dann"], acc["dann"])
    out = [f"dsn_dann - source_only, paired over seeds: {gain.text(100, sign=True)} points (bar: +{BAR:g})",
           f"dsn_dann - dann, paired over seeds: {lead.text(100, sign=True)} points"]
    if gain.low is not None and 100 * gain.low >= BAR:
        out.append(f"supported: the gain over source-only is at least {BAR:g} points (the whole interval)")
    elif 100 * gain.mean >= BAR:
        out.append(f"the mean gain reaches {BAR:g} points, the interval does not exclude less: the bar is met by "
                   "the mean only")
    else:
        out.append(f"not supported: the mean gain is below {BAR:g} points")
    if lead.excludes(0) and lead.mean > 0:
        out.append("supported: DSN-DANN beats DANN alone (the paired interval excludes 0)")
    else:
        out.append("not supported: DSN-DANN beating DANN alone (the paired interval does not exclude 0"
                   + (", or there is none" if lead.low is None else "") + ")")
    if selected_on != "val":
        out.append("caution: these settings were not chosen on a validation split (docs/multidsn.md: about 20 "
                   "configurations were read on these test digits); the numbers include that selection")
    return out
