import pytest
from hypothesis import given
from hypothesis import strategies as st

from devicekit.errors import DeviceKitError, InvalidSizeError
from devicekit.units import format_duration, format_size, parse_percent, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [("20GiB", 20 * 2**30), ("20G", 20 * 2**30), ("20GB", 20 * 2**30), ("20gb", 20 * 2**30),
     ("512MB", 512 * 2**20), ("512MiB", 512 * 2**20), ("1.5 KiB", 1536), ("1.5KB", 1536),
     ("0", 0), ("100B", 100), ("2tb", 2 * 2**40), (4096, 4096), (float(2**30), 2**30)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["10XB", "", "GiB", "-5GiB", "1..2G", -1, True, None, float("nan"),
                                 "1e400GiB", "1e309", "20", "0.5", "100",
                                 0.5, 1.5])
def test_parse_size_rejects_with_value_named(bad):
    with pytest.raises(InvalidSizeError) as info:
        parse_size(bad, name="--min-free")
    message = str(info.value)
    assert "--min-free" in message and repr(bad) in message
    assert "\n" not in message
    assert isinstance(info.value, DeviceKitError)


def test_format_size():
    assert format_size(0) == "0 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(80 * 2**30) == "80 GiB"
    assert format_size(-2 * 2**20) == "-2 MiB"


@given(st.integers(min_value=0, max_value=2**50))
def test_format_then_parse_is_close(n):
    text = format_size(n, precision=3).replace(" ", "")
    back = parse_size(text)
    assert abs(back - n) <= max(n * 0.001, 1)


def test_parse_percent():
    assert parse_percent("50%") == 50.0
    assert parse_percent(7) == 7.0
    with pytest.raises(InvalidSizeError, match="'150'"):
        parse_percent("150")


@pytest.mark.parametrize("bare", ["20", "0.5", " 40 "])
def test_a_bare_number_string_is_refused_naming_the_missing_unit(bare):
    # `--min-free 20` used to mean 20 bytes: every GPU qualified, silently
    with pytest.raises(InvalidSizeError, match="has no unit.*e.g. '20GiB'"):
        parse_size(bare, name="--min-free")


def test_numbers_in_a_hand_written_file_need_a_unit():
    assert parse_size("80GiB", bare=False) == 80 * 2**30
    with pytest.raises(InvalidSizeError, match="memory_total 80 has no unit"):
        parse_size(80, name="memory_total", bare=False)


def test_the_rule_is_documented_once_in_docs_sizes():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "sizes.md").read_text()
    assert "GB" in doc and "GiB" in doc and "no unit" in doc


@pytest.mark.parametrize("seconds,text", [
    (0, "0s"), (0.5, "0.5s"), (1, "1s"), (45, "45s"), (59.6, "1m"), (90, "1m30s"),
    (125, "2m05s"), (1800, "30m"), (3725, "1h02m"), (7200, "2h"), (86399, "23h59m"),
    (90000, "1d01h"), (9999 * 86400 + 86399, "9999d23h"),
])
def test_format_duration_one_style(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds,text", [
    (float("nan"), "?"), (float("inf"), ">9999d"), (-float("inf"), "0s"), (-5, "0s"),
    (1e300, ">9999d"), (10**400, ">9999d"), (-(10**400), "0s"), (5e-324, "<0.01s"),
    (None, "?"), ("12", "?"), (True, "?"), ([], "?"),
])
def test_format_duration_of_anything_is_short_and_never_raises(seconds, text):
    # a peer's lease age or a ticket's limit reaches it as the document wrote it
    assert format_duration(seconds) == text


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers())
def test_format_duration_is_bounded(seconds):
    assert 1 <= len(format_duration(seconds)) <= 8
