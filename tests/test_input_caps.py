"""Bounded reading of file arguments (events.tools.limits) and the readers built on it: a
capture, a trace and a token file are refused at their caps, never read until memory runs
out; a medium name with a non-ASCII digit is a level of its own, not a ValueError."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.tools.capture import CaptureError, read_capture, write_capture
from events.tools.limits import InputTooLarge, bounded_lines, read_bounded_text
from events.wire.codec import decode_batch
from events.wire.model import Stored, cache_level_of
from router_sim.run_args import check_requests_fit
from router_sim.sim.trace import TraceError, iter_trace
from router_sim.sim.workloads import Request

DEV_ZERO = Path("/dev/zero")
needs_dev_zero = pytest.mark.skipif(not DEV_ZERO.exists(), reason="no /dev/zero here")


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("ab\n\x00é"), max_size=60),
    max_line=st.integers(1, 12),
    max_total=st.integers(1, 80),
)
def test_bounded_lines_yield_the_file_or_refuse_at_a_cap(
    text: str, max_line: int, max_total: int
) -> None:
    """Either every line comes back as ``str.splitlines(keepends=True)`` would give it, numbered
    from 1, or InputTooLarge, exactly when a line or the total is over its cap."""
    lines = text.splitlines(keepends=True) if "\r" not in text else []
    over = any(len(line) > max_line for line in lines) or len(text) > max_total
    got: list[tuple[int, str]] = []
    try:
        for item in bounded_lines(io.StringIO(text), "f", max_line, max_total):
            got.append(item)
    except InputTooLarge:
        assert over
        # refused before reading past the cap: what came back is within both caps
        assert all(len(line) <= max_line for _, line in got)
        assert sum(len(line) for _, line in got) <= max_total
    else:
        assert not over
        assert got == list(enumerate(lines, 1))


def test_bounded_lines_stop_inside_an_endless_line() -> None:
    class Endless(io.TextIOBase):
        """A stream of NULs that never ends (what /dev/zero reads as)."""

        def readline(self, size: int | None = -1) -> str:
            assert size is not None and size > 0, "an unbounded readline"
            return "\0" * size

    with pytest.raises(InputTooLarge, match="f line 1 is over 1 KiB"):
        next(bounded_lines(Endless(), "f", 1024, 1 << 30))


def test_read_bounded_text(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_text("1, 2, 3")
    assert read_bounded_text(path, "--x", 7) == "1, 2, 3"
    with pytest.raises(InputTooLarge, match=r"--x .* is larger than 6 bytes"):
        read_bounded_text(path, "--x", 6)


@needs_dev_zero
def test_dev_zero_is_refused_by_every_file_reader() -> None:
    from events.stream.security import SecurityError, load_keypair
    from router_sim.cli import build_parser
    from router_sim.service.fleet import FleetError, load_fleet
    from router_sim.service.settings import ConfigError, resolve

    with pytest.raises(FleetError, match="fleet file /dev/zero is larger than 64 MiB"):
        load_fleet(DEV_ZERO)
    with pytest.raises(ConfigError, match="config file /dev/zero is larger than 1 MiB"):
        resolve(build_parser().parse_args(["serve", "--config", str(DEV_ZERO)]))
    with pytest.raises(SecurityError, match="CURVE key file /dev/zero is larger than 64 KiB"):
        load_keypair(DEV_ZERO)
    with pytest.raises(InputTooLarge, match="larger than 1 MiB"):
        read_bounded_text(DEV_ZERO, "--tokens-file", 1 << 20)
    with pytest.raises(CaptureError, match="line 1 is over 1 KiB"):
        read_capture(DEV_ZERO, max_line=1024)
    with pytest.raises(CaptureError, match="line 1 is over 64 MiB"):
        read_capture(DEV_ZERO)
    with pytest.raises(TraceError, match="line 1 is over 64 MiB"):
        next(iter_trace(DEV_ZERO))


def test_a_capture_is_refused_past_its_total(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    write_capture(path, [(0, [b"t", b"\0" * 8, b"x" * 100])] * 20)
    assert len(read_capture(path).messages) == 20
    with pytest.raises(CaptureError, match="the capture is over 2 KiB of text"):
        read_capture(path, max_total=2048)


def test_a_gzip_bomb_trace_is_refused_at_the_line_cap(tmp_path: Path) -> None:
    path = tmp_path / "bomb.jsonl.gz"
    with gzip.open(path, "wb") as out:  # 80 MiB of one line, ~80 KB compressed
        chunk = b"[" * (1 << 20)
        for _ in range(80):
            out.write(chunk)
    assert path.stat().st_size < 1 << 20
    with pytest.raises(TraceError, match="line 1 is over 64 MiB"):
        next(iter_trace(path))


@pytest.mark.parametrize("depth", [100_000])
def test_a_deeply_nested_trace_line_is_a_trace_error(tmp_path: Path, depth: int) -> None:
    row = '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "x": '
    for text in (row + "[" * depth + "]" * depth + "}", '{"a":' * depth + "1" + "}" * depth):
        path = tmp_path / "deep.jsonl"
        path.write_text(text + "\n")
        with pytest.raises(TraceError, match="nested too deeply"):
            next(iter_trace(path))


def test_requests_that_all_overflow_the_device_tier_are_refused() -> None:
    # 4-token blocks, 2 device blocks: 8 tokens fit (prompt + output), 9 do not
    fits = Request(0, 0.0, 6, 2, hash_ids=(1,), tokens_per_hash_id=8)
    too_big = Request(1, 0.0, 7, 2, hash_ids=(1,), tokens_per_hash_id=8)
    assert check_requests_fit([fits, too_big], 4, 2) == 1
    with pytest.raises(ValueError, match=r"every one of the 2 requests .* need 3 to 3"):
        check_requests_fit([too_big, too_big], 4, 2)
    assert check_requests_fit([], 4, 2) == 0


def test_a_superscript_digit_in_a_medium_is_a_level_of_its_own() -> None:
    assert "²".isdigit()  # what made int() raise out of the decoder
    assert cache_level_of("TIER2") == 2
    level = cache_level_of("TIER²")
    assert level == cache_level_of("tier²") and level not in (0, 1, 2)
    assert cache_level_of("TIER٣") != 3  # an Arabic-Indic three, which int() would take
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
        "lora_id": None,
        "medium": "TIER²",
    }
    batch = decode_batch(msgspec.msgpack.encode([1.0, [event], None]))
    assert batch.malformed == []
    (decoded,) = batch.events
    assert isinstance(decoded.data, Stored) and decoded.data.blocks[0].cache_level == level
