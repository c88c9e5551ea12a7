"""The rate parser of --upload-limit / --download-limit (diloco_node/rates.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from diloco_node.rates import MAX_RATE, MIN_RATE, format_rate, parse_rate


@pytest.mark.parametrize(("text", "expected"), [
    ("5mbit", 625_000.0),
    ("10Mbit/s", 1_250_000.0),
    ("20Mbps", 2_500_000.0),
    ("2MB/s", 2_000_000.0),
    ("500kB/s", 500_000.0),
    ("500KB", 500_000.0),
    ("1.5MiB/s", 1.5 * 1024 ** 2),
    ("8 kbit", 1000.0),
    ("1gbit", 125_000_000.0),
    ("3 Mb/s", 375_000.0),
    ("2 MBps", 2_000_000.0),
    ("4 bytes/s", None),  # below the minimum: checked below
    ("0", 0.0), ("0.0", 0.0), ("0kbit", 0.0), (0, 0.0), (0.0, 0.0),
])
def test_parses_what_a_volunteer_writes(text, expected):
    if expected is None:
        with pytest.raises(ValueError, match="below"):
            parse_rate(text)
    else:
        assert parse_rate(text) == pytest.approx(expected)


@pytest.mark.parametrize(("text", "says"), [
    ("-1", "is not a rate"),
    ("5 parsecs", "is not a rate"),
    ("", "is not a rate"),
    ("mbit", "is not a rate"),
    ("nan", "is not a rate"),
    ("inf kbit", "is not a rate"),
    ("5", "has no unit"),
    (5, "has no unit"),
    (True, "is not a rate"),
    ("5 bitps", "is not a rate"),
    ("100 bit/s", "below"),
    ("99Gbit/s", None),  # fine: 12.4 GB/s
    ("1e13 B/s", "beyond any link"),
])
def test_refuses_in_one_line(text, says):
    if says is None:
        assert parse_rate(text) > 0
        return
    with pytest.raises(ValueError, match=says) as raised:
        parse_rate(text)
    assert "\n" not in str(raised.value)


PREFIXES = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "m": 1e6, "G": 1e9, "Ki": 1024.0, "Mi": 1024.0 ** 2}
UNITS = {"bit": 1 / 8, "bits": 1 / 8, "b": 1 / 8, "bps": 1 / 8, "B": 1.0, "byte": 1.0, "bytes": 1.0}


@given(number=st.floats(min_value=0.001, max_value=1e6, allow_nan=False, allow_infinity=False),
       prefix=st.sampled_from(sorted(PREFIXES)), unit=st.sampled_from(sorted(UNITS)),
       per=st.sampled_from(["", "/s"]), space=st.sampled_from(["", " "]))
def test_any_written_rate_reads_as_its_value(number, prefix, unit, per, space):
    text = f"{number!r}{space}{prefix}{unit}{per}"
    value = number * PREFIXES[prefix] * UNITS[unit]
    if MIN_RATE <= value <= MAX_RATE:
        assert parse_rate(text) == pytest.approx(value, rel=1e-12)
    else:
        with pytest.raises(ValueError):
            parse_rate(text)


@given(st.floats(min_value=MIN_RATE, max_value=MAX_RATE))
def test_a_formatted_rate_reads_back(rate):
    assert parse_rate(format_rate(rate)) == pytest.approx(rate, rel=1e-3)


def test_format_says_none_for_no_cap():
    assert format_rate(0) == "none"
    assert format_rate(250_000) == "2 Mbit/s"
