"""The notebook and terminal sinks, rendering into an in-memory publisher."""

import io

import pytest

from monarch_kernel.views.live import LiveOutput, TerminalOutput, label_bundle

pytestmark = pytest.mark.unit  # starts no process (checked: tests/conftest.py)


class Publisher:
    """Records what would be sent to the frontend (display ids and their latest bundle)."""

    def __init__(self):
        self.shown = {}
        self.order = []
        self.updates = 0

    def show(self, bundle, metadata=None, *, live=True):
        display_id = f"d{len(self.order)}"
        self.shown[display_id] = bundle
        self.order.append(display_id)
        return display_id

    def update(self, display_id, bundle):
        self.updates += 1
        self.shown[display_id] = bundle


def test_first_line_shows_at_once_then_updates_in_place():
    pub = Publisher()
    live = LiveOutput((0, 1), dedupe=True, publisher=pub)
    live.output(0, "stdout", "hello\n")
    assert pub.shown["d0"]["text/plain"] == "[0] hello"
    live.output(1, "stdout", "hello\n")
    live.close()
    assert pub.order == ["d0"] and pub.shown["d0"]["text/plain"] == "[0-1] hello"


def test_updates_are_throttled():
    pub = Publisher()
    live = LiveOutput((0,), dedupe=True, publisher=pub)
    for i in range(200):
        live.output(0, "stdout", f"{i}\n")
    assert pub.updates < 20
    live.close()
    assert pub.shown["d0"]["text/plain"].count("\n") == 199


def test_rich_display_freezes_text_and_text_continues_below():
    pub = Publisher()
    live = LiveOutput((0,), dedupe=True, publisher=pub)
    live.output(0, "stdout", "before\n")
    live.display(0, {"text/plain": "<Figure>", "image/png": "AAAA"}, {})
    live.output(0, "stdout", "after\n")
    live.close()
    first, figure, last = (pub.shown[d] for d in pub.order)
    assert first["text/plain"] == "[0] before" and last["text/plain"] == "[0] after"
    assert figure["text/plain"] == "[rank 0] <Figure>" and "rank 0" in figure["text/html"]
    assert "data:image/png;base64,AAAA" in figure["text/html"]


def test_notice_shows_immediately():
    pub = Publisher()
    live = LiveOutput((0, 1), dedupe=True, publisher=pub)
    live.notice(1, "rank 1 died: exit code 3")
    assert "[1]!rank 1 died: exit code 3" in pub.shown["d0"]["text/plain"]


def test_background_announcement_is_replaced():
    pub = Publisher()
    live = LiveOutput((0,), dedupe=True, publisher=pub, announcement="running...")
    assert pub.shown["d0"] == {"text/plain": "running..."}
    live.output(0, "stdout", "done\n")
    live.close()
    assert pub.shown["d0"]["text/plain"] == "[0] done"


def test_terminal_prints_only_settled_lines_once():
    out = io.StringIO()
    term = TerminalOutput((0, 1), dedupe=True, stream=out)
    term.output(0, "stdout", "a\nb\n")
    assert out.getvalue() == ""  # rank 1 may still print "a"
    term.output(1, "stdout", "a\n")
    assert out.getvalue() == "[0-1] a\n"
    term.rank_done(1)
    term.close()
    assert out.getvalue() == "[0-1] a\n[0] b\n"


def test_label_bundle_keeps_other_mimetypes():
    bundle = label_bundle(3, {"text/plain": "x", "application/json": {"a": 1}})
    assert bundle["application/json"] == {"a": 1} and bundle["text/plain"] == "[rank 3] x"


def test_long_outputs_are_redrawn_less_often(monkeypatch):
    import monarch_kernel.views.live as live_module

    clock = [0.0]
    monkeypatch.setattr(live_module.time, "monotonic", lambda: clock[0])
    class Counting(Publisher):
        sent = 0

        def update(self, display_id, bundle):
            super().update(display_id, bundle)
            self.sent += len(bundle["text/plain"]) + len(bundle["text/html"])

    pub = Counting()
    live = LiveOutput((0, 1), dedupe=True, publisher=pub)
    for i in range(20_000):  # a training loop logging every step, one step per millisecond
        clock[0] += 0.001
        live.output(i % 2, "stdout", f"step {i // 2} loss {i * 0.37 % 1:.4f} rank {i % 2}\n")
    sent = pub.sent
    assert pub.updates > 10  # still live
    assert sent / clock[0] < 2 * 1_000_000  # bounded bandwidth (about MAX_BYTES_PER_S), not 20 redraws a second
    live.close()
    assert "10,000 more lines" in pub.shown["d0"]["text/plain"]  # the cap on shown lines still holds


def test_a_new_block_keeps_earlier_text_above_what_follows():
    pub = Publisher()
    live = LiveOutput((0, 1), dedupe=True, publisher=pub)
    live.output(0, "stdout", "before\n")
    live.new_block()  # e.g. the notebook asks for input here
    live.output(1, "stdout", "after\n")
    live.close()
    assert [pub.shown[d]["text/plain"] for d in pub.order] == ["[0] before", "[1] after"]
    out = io.StringIO()
    term = TerminalOutput((0,), dedupe=True, stream=out)
    term.output(0, "stdout", "partial line")
    term.new_block()
    assert out.getvalue() == "[0] partial line\n"
