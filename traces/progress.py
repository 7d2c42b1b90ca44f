"""The progress bar of the long-running trace commands (`replay`, `simulate`,
`profile`): tqdm on stderr, so stdout keeps only the results."""

from __future__ import annotations

import sys


def progress_bar(total: int, desc: str, unit: str, enabled: bool = True):
    """A tqdm bar over `total` units. When not `enabled` it is tqdm's disabled
    bar: `update`, `set_postfix_str` and `close` do nothing, and the caller
    needs no second code path."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, smoothing=0.1, file=sys.stderr, disable=not enabled)


def log_line(msg: str) -> None:
    """A line on stderr that does not break a progress bar drawn there."""
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)
