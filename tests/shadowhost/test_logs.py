"""Following a shadow's log: whole lines from any offset, no loss or repeat, and an end once it has exited."""

from pathlib import Path

from shim.shadowhost.logs import CHUNK, Life, cap, follow


class _Container:
    """A container whose log a test writes, and whose life it moves on as the follower waits."""

    def __init__(self, path: Path, script: list) -> None:
        self.path, self.script, self.life = path, list(script), Life.RUNNING

    def wait(self, _seconds: float) -> None:
        if self.script:
            self.script.pop(0)(self)

    def write(self, data: bytes):
        def step(c: "_Container") -> None:
            with open(c.path, "ab") as f:
                f.write(data)
        return step

    @staticmethod
    def exit(c: "_Container") -> None:
        c.life = Life.EXITED


def _follow(c: _Container, offset: int = 0) -> list[tuple[int, bytes]]:
    return list(follow(c.path, offset, lambda: c.life, lambda: True, c.wait, state_every=0))


def test_the_log_is_sent_as_it_grows_in_whole_lines_and_ends_after_the_exit(tmp_path: Path) -> None:
    log = tmp_path / "0.log"
    c = _Container(log, [])
    c.script = [c.write(b"line 1\nline 2\nhalf"), c.write(b" a line\n"), c.write(b"last, no newline"), c.exit]
    chunks = _follow(c)
    assert chunks == [(0, b"line 1\nline 2\n"), (14, b"half a line\n"), (26, b"last, no newline")]


def test_from_a_middle_offset_nothing_is_lost_or_repeated(tmp_path: Path) -> None:
    log = tmp_path / "0.log"
    content = b"".join(b"2024-01-01T00:00:00Z stdout F line %d\n" % i for i in range(20000))
    log.write_bytes(content)
    c = _Container(log, [_Container.exit])
    middle = content.index(b"line 7000\n") - len(b"2024-01-01T00:00:00Z stdout F ")
    chunks = _follow(c, middle)
    assert all(len(d) <= CHUNK and d.endswith(b"\n") for _, d in chunks)
    assert [o for o, _ in chunks] == [middle + sum(len(d) for _, d in chunks[:i]) for i in range(len(chunks))]
    assert b"".join(d for _, d in chunks) == content[middle:]


def test_a_log_that_does_not_exist_yet_is_waited_for(tmp_path: Path) -> None:
    log = tmp_path / "0.log"
    c = _Container(log, [])
    c.life = Life.CREATED
    c.script = [lambda c: None, c.write(b"hello\n"), c.exit]
    assert _follow(c) == [(0, b"hello\n")]


def test_no_log_and_an_exited_container_is_an_empty_stream(tmp_path: Path) -> None:
    c = _Container(tmp_path / "never.log", [])
    c.life = Life.GONE
    assert _follow(c) == []


def test_the_stream_ends_when_the_reader_goes_away(tmp_path: Path) -> None:
    log = tmp_path / "0.log"
    log.write_bytes(b"a\n")
    active = iter([True, True, False])
    assert list(follow(log, 0, lambda: Life.RUNNING, lambda: next(active), lambda s: None)) == [(0, b"a\n")]


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_what_was_sent_leaves_the_disk_and_a_reader_resuming_there_starts_at_a_line(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    line = b"2026-12-03T10:00:00.000000000Z stdout F " + b"y" * 1000 + b"\n"
    log.write_bytes(line * 8192)  # 8 MiB
    c = _Container(log, [_Container.exit])
    sent = b"".join(data for _, data in follow(log, 0, lambda: c.life, lambda: True, c.wait, state_every=0,
                                               keep_sent=1 << 20))
    assert sent == line * 8192
    assert log.stat().st_size == len(line) * 8192  # offsets stay
    assert _allocated(log) <= (1 << 20) + (CHUNK * 2)  # all but the last MiB sent is freed
    resumed = _follow(_Container(log, [_Container.exit]), 4096)  # inside the punched part
    assert resumed and resumed[0][1].startswith(b"2026-") and b"\0" not in b"".join(d for _, d in resumed)


def test_a_backlog_past_its_cap_drops_the_oldest_from_a_line_end(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    line = b"2026-12-03T10:00:00.000000000Z stdout F " + b"y" * 100 + b"\n"
    log.write_bytes(line * 100000)  # ~14 MiB waiting
    c = _Container(log, [_Container.exit])
    chunks = list(follow(log, 0, lambda: c.life, lambda: True, c.wait, state_every=0, max_backlog=1 << 20))
    first_offset, first = chunks[0]
    assert first_offset >= log.stat().st_size - (1 << 20) and first_offset % len(line) == 0
    assert first.startswith(b"2026-")
    assert sum(len(d) for _, d in chunks) <= 1 << 20


def test_a_log_no_one_reads_is_kept_to_its_cap_and_a_reader_later_starts_at_a_line(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    line = b"2026-12-03T10:00:00.000000000Z stdout F " + b"y" * 100 + b"\n"
    log.write_bytes(line * 100000)  # ~14 MiB, none of it sent
    size = log.stat().st_size
    assert cap(log, max_backlog=1 << 20) > 10 << 20
    assert log.stat().st_size == size and _allocated(log) <= (1 << 20) + 2 * CHUNK  # offsets stay, blocks freed
    assert cap(log, max_backlog=1 << 20) == 0  # nothing more to free
    resumed = _follow(_Container(log, [_Container.exit]))  # the origin back, from where it was (0)
    assert resumed[0][1].startswith(b"2026-") and resumed[0][0] % len(line) == 0
    assert b"".join(d for _, d in resumed) == line * (len(b"".join(d for _, d in resumed)) // len(line))
