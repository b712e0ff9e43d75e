import time

import pytest

from monarch_kernel.rank import capture
from monarch_kernel.rank.capture import DisplayCapture, RankStream, mime_bundle
from monarch_kernel.wire.messages import Display, Output

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


def test_stream_batches_writes_and_tags_requests():
    sent = []
    stream = RankStream("stdout", 2, sent.append)
    stream.request_id = 5
    for i in range(100):
        stream.write(f"line {i}\n")
    stream.flush()
    text = "".join(m.text for m in sent)
    assert text == "".join(f"line {i}\n" for i in range(100))
    assert len(sent) < 10 and all(m.req_id == 5 and m.rank == 2 for m in sent)


def test_flusher_sends_without_explicit_flush():
    sent = []
    stream = RankStream("stdout", 0, sent.append)
    stream.request_id = 1
    stream.write("hello\n")
    deadline = time.monotonic() + 2
    while not sent and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sent and sent[0] == Output(0, 1, "stdout", "hello\n")


def test_output_per_request_is_capped_and_the_drop_reported(monkeypatch):
    monkeypatch.setattr(capture, "MAX_OUTPUT_PER_REQUEST", 1000)
    sent = []
    stream = RankStream("stdout", 0, sent.append)
    stream.request_id = 9
    for _ in range(50):
        stream.write("x" * 99 + "\n")
    stream.finish_request(9)
    shown = "".join(m.text for m in sent if m.stream == "stdout")
    assert len(shown) == 1000
    assert "4,000 more characters of stdout" in sent[-1].text


def test_display_builds_mime_bundles():
    class Rich:
        def _repr_html_(self):
            return "<b>hi</b>"

    sent = []
    DisplayCapture(1, sent.append, lambda: 3, lambda: None).display(Rich(), "plain")
    assert isinstance(sent[0], Display) and sent[0].data["text/html"] == "<b>hi</b>"
    assert sent[1].data == {"text/plain": "'plain'"}
    assert mime_bundle(3)[0] == {"text/plain": "3"}


def test_progress_bars_send_their_latest_state_and_are_not_capped(monkeypatch):
    monkeypatch.setattr(capture, "MAX_OUTPUT_PER_REQUEST", 1000)
    sent = []
    stream = RankStream("stderr", 0, sent.append)
    stream.request_id = 4
    for i in range(2000):  # 20,000 characters of progress: twenty times the cap
        stream.write(f"\rstep {i:4d}")
        if i % 100 == 99:
            stream.flush()
    stream.write("\ndone\n")
    stream.finish_request(4)
    text = "".join(m.text for m in sent)
    assert "\rstep 1999\ndone\n" in text and "dropped" not in text
    assert text.count("\r") < 500  # one state per burst, not all 2,000 printed


def test_output_outside_requests_gets_its_budget_back_and_the_drop_is_said(monkeypatch):
    """N7: the budget of request id None was never refilled and its drop never reported: after 8M
    characters in a rank's life, every later print of an actor endpoint vanished without a word."""
    monkeypatch.setattr(capture, "MAX_OUTPUT_PER_REQUEST", 1000)
    sent = []
    stream = RankStream("stdout", 3, sent.append)
    for _ in range(50):
        stream.write("x" * 99 + "\n")  # an endpoint prints far over its budget
    stream.flush()
    stream._idle_since -= capture.IDLE_WINDOW_S  # the window ends (as its clock would say)
    stream.write("MARKER-after\n")
    stream.flush()
    shown = "".join(m.text for m in sent)
    assert "MARKER-after" in shown
    assert "were dropped" in shown and "printed outside any cell" in shown
    assert all(m.req_id is None for m in sent)


def test_idle_output_on_the_controller_is_bounded():
    """N7: a newline-free stream outside any cell (a progress stream, a C library) was kept whole and
    re-joined on every chunk, on the controller loop all meshes share (16 MiB cost 10.6 s)."""
    import io
    import sys

    from monarch_kernel.api.sinks import IdleOutput

    now = [0.0]
    idle = IdleOutput(clock=lambda: now[0])
    out, err = io.StringIO(), io.StringIO()
    real = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        chunk = "y" * (64 << 10)
        for _ in range(256):  # 16 MiB without a newline
            idle.write(0, "stdout", chunk)
        assert max(idle._partial_len.values()) <= IdleOutput.PARTIAL_KEPT  # kept bounded, not whole
        idle.write(0, "stdout", "\n")
        now[0] += IdleOutput.IDLE_WINDOW_S  # the next window
        idle.write(0, "stdout", "after\n")
    finally:
        sys.stdout, sys.stderr = real
    lines = out.getvalue().splitlines()
    assert lines[-1] == "[rank 0] after" and len(lines[0]) <= IdleOutput.PARTIAL_KEPT + len("[rank 0] ")
    assert "the rest is dropped" in err.getvalue() and "characters printed outside any cell were dropped" in err.getvalue()
