"""A mesh's rank table as text and HTML (what `%mesh status` shows)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from .meshview import STATE_COLOURS

if TYPE_CHECKING:
    from .mesh import Mesh



def _detail(s) -> str:
    if s.state == "dead":
        return f"killed by {s.signal}" if s.signal else f"exit code {s.exit_code}"
    if s.state == "busy" and s.busy_for_s is not None:
        return f"for {s.busy_for_s:.1f} s"
    return ""


def status_rows(mesh: Mesh) -> list[tuple[str, ...]]:
    """(rank, coords, host, pid, state, detail) for each rank of the mesh."""
    coords = {p.rank: ", ".join(f"{k}={v}" for k, v in p.items()) for p in mesh.shape.points()}
    return [(str(s.rank), coords.get(s.rank, ""), s.host, str(s.pid or "-"), s.state, _detail(s))
            for s in mesh.status()]


def status_bundle(mesh: Mesh, *, default: bool = False) -> dict[str, Any]:
    """MIME bundle (text/plain + text/html) of the mesh's rank table."""
    title = f"mesh {mesh.name!r} {mesh.shape} dist={mesh.backend}" + (" (default)" if default else "")
    if mesh.closed:
        return {"text/plain": title + ": shut down", "text/html": f"<b>{html.escape(title)}</b>: shut down"}
    header = ("rank", "coords", "host", "pid", "state", "")
    rows = status_rows(mesh)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])
    cells = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r[:4])
        + f"<td style='color:{STATE_COLOURS.get(r[4], '#000')};font-weight:bold'>{r[4]}</td>"
        + f"<td>{html.escape(r[5])}</td></tr>" for r in rows)
    head = "".join(f"<th>{h}</th>" for h in header)
    return {"text/plain": f"{title}\n{text}",
            "text/html": f"<div><b>{html.escape(title)}</b><table><tr>{head}</tr>{cells}</table></div>"}
