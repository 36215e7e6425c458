"""Bandwidths and durations with units: exact values, and one-line errors naming the form."""

from __future__ import annotations

import math

import pytest

from shrinkgrad.network.units import (
    BANDWIDTH_FORM,
    DURATION_FORM,
    format_bandwidth,
    format_duration,
    parse_bandwidth,
    parse_duration,
)


@pytest.mark.parametrize(
    ("text", "bits_per_s"),
    [
        ("10mbit", 10e6),
        ("10Mbit", 10e6),
        ("1gbit", 1e9),
        ("100kbit/s", 100e3),
        ("50Mbps", 50e6),
        ("2.5e3kbit", 2.5e6),
        ("10Mb", 10e6),  # b = bit
        ("12.5MB/s", 100e6),  # B = byte: × 8
        ("1.25GByte", 10e9),
        ("3bytes", 24.0),
        ("10", 10.0),  # a bare number (in a string too) is bit/s
        ("100MBps", 800e6),
        ("inf", math.inf),
        (1e9, 1e9),
        (12, 12.0),
    ],
)
def test_bandwidths_in_bits_per_second(text: object, bits_per_s: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bits_per_s, rel=1e-15)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("20ms", 0.02), ("50us", 50e-6), ("50µs", 50e-6), ("0.05s", 0.05), ("3ns", 3e-9), (0, 0.0)],
)
def test_durations_in_seconds(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds, rel=1e-15)


@pytest.mark.parametrize("bad", ["-1mbit", "0mbit", 0, -3.0])
def test_a_bandwidth_must_be_positive(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^up must be > 0, got .*; give a bandwidth such as"):
        parse_bandwidth(bad, "up")


@pytest.mark.parametrize("bad", ["10mbat", "fast", "mbit", True, None, "nan", "10 m bit"])
def test_an_unknown_unit_names_the_parameter_and_the_form(bad: object) -> None:
    with pytest.raises(ValueError) as e:
        parse_bandwidth(bad, "star parameter 'up'")
    assert str(e.value) == f"star parameter 'up': cannot read {bad!r}; give {BANDWIDTH_FORM}"


@pytest.mark.parametrize("bad", ["20 parsecs", "-5ms", "inf", "1h", True])
def test_duration_errors(bad: object) -> None:
    with pytest.raises(ValueError, match=r"latency.*give a duration such as") as e:
        parse_duration(bad, "latency")
    assert DURATION_FORM in str(e.value) and "\n" not in str(e.value)


def test_readable_formats() -> None:
    assert format_bandwidth(10e6) == "10 Mbit/s" and format_bandwidth(1.5e9) == "1.5 Gbit/s"
    assert format_bandwidth(math.inf) == "inf" and format_bandwidth(12.0) == "12 bit/s"
    assert format_duration(0.02) == "20 ms" and format_duration(50e-6) == "50 µs"
    assert format_duration(5400.0) == "1.5 h" and format_duration(0.0) == "0 s"
