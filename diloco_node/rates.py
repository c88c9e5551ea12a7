"""Link rates as a volunteer writes them: `5mbit`, `10Mbit/s`, `20Mbps`, `2MB/s`, `500kB/s`, `0`.

A leaf (docs/architecture.md §8): config/ validates `--upload-limit` / `--download-limit` with it.
Units follow the conventions of ISPs and of `tc`'s `mbit`: a lowercase `b` or the word `bit` is
bits, an uppercase `B` or `byte` is bytes; `bps` is bits per second (as ISPs sell them; `tc` reads
it as bytes, a volunteer does not). Prefixes k, M, G are powers of 1000, Ki, Mi, Gi of 1024; a
trailing `/s` or `ps` may be written or left out. A bare number is refused unless it is 0 (no
cap): `--upload-limit 5` would be read as bits by some and bytes by others, an eightfold error.
"""

from __future__ import annotations

import math
import re

MIN_RATE = 1000.0  # bytes/s (8 kbit/s): below it a node could not even keep its records alive
MAX_RATE = 1e12  # bytes/s (8 Tbit/s): a typo, not a link
_RATE = re.compile(r"^\s*(?P<number>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"
                   r"(?P<prefix>[kKmMgG]i?)?(?P<unit>bits?|bytes?|bps|b|B)?(?P<per>/s|ps)?\s*$")
_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "ki": 1024.0, "mi": 1024.0 ** 2, "gi": 1024.0 ** 3}


def parse_rate(text: str | float | int) -> float:
    """`text` as bytes per second (0: no cap); ValueError naming what is wrong, in one line."""
    if isinstance(text, bool):
        raise ValueError(f"'{text}' is not a rate")
    if isinstance(text, int | float):
        if text == 0:
            return 0.0
        raise ValueError(f"'{text}' has no unit: write e.g. 5mbit or 2MB/s (0 for no cap)")
    match = _RATE.match(text)
    if match is None:
        raise ValueError(f"'{text}' is not a rate such as 5mbit, 10Mbit/s, 2MB/s or 500kB/s (0 for no cap)")
    number = float(match["number"])
    prefix, unit, per = (match["prefix"] or ""), match["unit"], match["per"]
    if unit is None:
        if number == 0 and not prefix and not per:
            return 0.0
        raise ValueError(f"'{text}' has no unit: write e.g. 5mbit or 2MB/s (0 for no cap)")
    if per == "ps" and unit not in ("b", "B"):  # "5bitps" is no rate anyone writes; "5bps" is caught as unit bps
        raise ValueError(f"'{text}' is not a rate such as 5mbit, 10Mbit/s, 2MB/s or 500kB/s (0 for no cap)")
    bits = unit in ("bit", "bits", "bps", "b")
    rate = number * _PREFIXES[prefix.lower()] / (8 if bits else 1)
    if rate == 0:
        return 0.0
    if not math.isfinite(rate) or rate > MAX_RATE:
        raise ValueError(f"'{text}' is beyond any link ({format_rate(MAX_RATE)} at most)")
    if rate < MIN_RATE:
        raise ValueError(f"'{text}' is below {format_rate(MIN_RATE)}: too little for a node to take part")
    return rate


def format_rate(bytes_per_second: float) -> str:
    """A rate for a log line or an error, in bits per second as links are sold: `5 Mbit/s`, `none`."""
    if bytes_per_second <= 0:
        return "none"
    bits = bytes_per_second * 8
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.4g} {prefix}bit/s"
    return f"{bits:.4g} bit/s"
