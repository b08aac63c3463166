"""``plan ... --report plan.html``: one self-contained HTML page about a plan.

Three figures, drawn with matplotlib (the ``viz`` extra) and inlined as SVG, so the page needs
no network and no other file: the pipeline schedule as a timeline per rank (one rank of phases
without a pipeline), memory per pipeline rank stacked by kind against the device's capacity, and
the predicted step time of the alternatives. Then the plan in words, the explanation
(:func:`planner.explain.explain`, passed in) and, if asked, the ``--why-not`` diff.

``render`` is pure (returns the HTML); ``write_report`` and ``save_figures`` write files.
"""

from __future__ import annotations

import html
import io
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from autopar.codegen.emit import _summary
from autopar.planner.explain import elastic_rows
from autopar.planner.plan import Plan

if TYPE_CHECKING:
    from autopar.planner.explain import Explanation, WhyNot
    from matplotlib.figure import Figure

__all__ = ["figures", "render", "save_figures", "write_report"]

KIND_COLORS = {
    "F": "#4878d0",
    "B": "#6acc64",
    "I": "#6acc64",
    "W": "#b5d99c",
    "tp_comm": "#ee854a",
    "cp_comm": "#dd8452",
    "dp_comm": "#d65f5f",
    "optimizer": "#956cb4",
}
KIND_NAMES = {
    "F": "forward",
    "B": "backward (+ recompute)",
    "I": "input grads",
    "W": "weight grads",
    "tp_comm": "TP comm",
    "cp_comm": "CP K/V comm",
    "dp_comm": "DP/FSDP comm",
    "optimizer": "optimizer",
}
MEMORY_COLORS = {
    "params": "#4878d0",
    "grads": "#ee854a",
    "optimizer": "#956cb4",
    "activations": "#6acc64",
    "buffers": "#8c8c8c",
}
_IDLE = "#e6e6e6"


def _matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError(
            "the HTML report draws its figures with matplotlib, which is not installed: "
            "pip install 'autopar[viz]' (or pip install matplotlib)"
        ) from None
    return Figure


def figures(plan: Plan, expl: Explanation) -> dict[str, tuple[Figure, str]]:
    """name -> (figure, caption) for the timeline, the memory and the alternatives."""
    Figure = _matplotlib()
    return {
        "timeline": _timeline(Figure, plan, expl),
        "memory": _memory(Figure, plan, expl),
        "alternatives": _alternatives(Figure, plan, expl),
    }


def render(
    plan: Plan,
    expl: Explanation,
    why_not: WhyNot | None = None,
    elastic: dict[int, Plan] | None = None,
) -> str:
    """The report as one HTML document; ``elastic`` (``plan --elastic``: node count -> plan)
    adds the plan and predicted throughput of each node count."""
    figs = figures(plan, expl)
    title = f"autopar plan: {plan.mesh.short()} on {plan.cluster.spec}"
    sections = [
        f"<h1>{html.escape(title)}</h1>",
        "<section><h2>The plan in words</h2>",
        "".join(f"<p>{html.escape(par)}</p>" for par in _summary(plan).split("\n\n")),
        f"<pre>{html.escape(plan.summary())}</pre></section>",
    ]
    headings = {
        "timeline": "Pipeline schedule" if plan.mesh.pp > 1 else "One step",
        "memory": "Memory per rank",
        "alternatives": "Alternatives",
    }
    for i, (name, (fig, caption)) in enumerate(figs.items()):
        svg = _svg(fig, salt=f"autopar-{name}-{i}")
        sections.append(
            f'<section><h2>{headings[name]}</h2><figure id="{name}">{svg}'
            f"<figcaption>{html.escape(caption)}</figcaption></figure></section>"
        )
    sections.append(f"<section><h2>Explanation</h2><pre>{html.escape(expl.text)}</pre></section>")
    if elastic is not None:
        sections.append(_elastic_section(elastic))
    if why_not is not None:
        sections.append(
            f"<section><h2>Why not {html.escape(why_not.pins)}?</h2>"
            f"<pre>{html.escape(why_not.text)}</pre></section>"
        )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )


def _elastic_section(plans: dict[int, Plan]) -> str:
    """A table row per node count: what losing (or gaining) a node costs, before it happens."""
    head = ("nodes", "ranks", "mesh", "accumulation", "step time", "throughput", "vs largest")
    cells = ["".join(f"<th>{h}</th>" for h in head)]
    for r in elastic_rows(plans):
        rate = (
            f"{r.tokens_per_s:,.0f} tokens/s"
            if r.tokens_per_s
            else f"{r.samples_per_s:.2f} samples/s"
        )
        row = (r.nodes, r.world_size, r.mesh, r.accumulation_steps,
               f"{r.step_time_s * 1e3:.3f} ms", rate, f"{100 * r.vs_largest:.0f}%")  # fmt: skip
        cells.append("".join(f"<td>{html.escape(str(x))}</td>" for x in row))
    rows = "".join(f"<tr>{c}</tr>" for c in cells)
    return (
        f"<section><h2>Elastic: {min(plans)} to {max(plans)} nodes</h2>"
        "<p>The plan emitted for each node count (plans/&lt;K&gt;nodes.py), same global batch; "
        "a run takes the one for the nodes it finds.</p>"
        f'<table id="elastic">{rows}</table></section>'
    )


def write_report(
    plan: Plan,
    path: str | Path,
    expl: Explanation,
    why_not: WhyNot | None = None,
    elastic: dict[int, Plan] | None = None,
) -> Path:
    """Render and write atomically (a temporary file renamed into place); returns the path."""
    text = render(plan, expl, why_not, elastic)
    out = Path(path).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def save_figures(plan: Plan, expl: Explanation, directory: str | Path, fmt: str = "png"):
    """Each figure as ``report_<name>.<fmt>`` in ``directory`` (the README's images)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (fig, _) in figures(plan, expl).items():
        path = out / f"report_{name}.{fmt}"
        fig.savefig(path, format=fmt, dpi=110, bbox_inches="tight", metadata=_metadata(fmt))
        paths.append(path)
    return paths


# -- figures -----------------------------------------------------------------------------------


def _timeline(Figure, plan: Plan, expl: Explanation) -> tuple[Figure, str]:
    blocks = expl.timeline
    ranks = max((b.rank for b in blocks), default=0) + 1
    fig = Figure(figsize=(11, 1.4 + 0.55 * ranks), layout="constrained")
    ax = fig.add_subplot()
    scale, unit = _time_unit(expl.timeline_s or expl.step_time_s)
    labels = len(blocks) <= 48 * ranks
    # a rank's second (virtual) stage is drawn lighter than its first
    chunk = {}
    for b in blocks:
        if b.stage is not None:
            chunk.setdefault(b.rank, [])
            if b.stage not in chunk[b.rank]:
                chunk[b.rank].append(b.stage)
    for b in blocks:
        y = ranks - 1 - b.rank
        width = (b.end_s - b.start_s) * scale
        color = KIND_COLORS.get(b.kind, "#cccccc")
        if b.stage is not None and sorted(chunk[b.rank]).index(b.stage) > 0:
            color = _lighter(color)
        ax.barh(y, width, left=b.start_s * scale, height=0.7, color=color, edgecolor="white",
                linewidth=0.6)  # fmt: skip
        if labels and b.microbatch is not None and plan.mesh.pp > 1:
            text = f"{b.kind}{b.microbatch}"
            if width > 0.028 * expl.timeline_s * scale * (len(text) / 2):
                ax.text(b.start_s * scale + width / 2, y, text, ha="center", va="center",
                        fontsize=7, color="white")  # fmt: skip
    ax.set_facecolor(_IDLE)
    ax.set_yticks(range(ranks), [f"rank {ranks - 1 - i}" for i in range(ranks)])
    ax.set_xlim(0, (expl.timeline_s or 1e-9) * scale * 1.01)
    ax.set_xlabel(f"time in the step ({unit})")
    kinds = list(dict.fromkeys(b.kind for b in blocks))
    handles = [_patch(KIND_COLORS.get(k, "#cccccc"), KIND_NAMES.get(k, k)) for k in kinds]
    handles.append(_patch(_IDLE, "idle (bubble)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if ranks < 3 else
              -0.22), ncol=len(handles), fontsize=8, frameon=False)  # fmt: skip
    pp_comm = expl.time_parts.get("pp_comm", 0.0)
    if plan.mesh.pp > 1:
        s = plan.schedule
        caption = (
            f"Approximate schedule of one step: {s.name}, {s.num_microbatches} microbatches, "
            f"{len(plan.stages)} stages on {plan.mesh.pp} pipeline ranks. Blocks (Fk: forward "
            "of microbatch k, Bk: backward, Ik/Wk: input/weight gradients; lighter: a rank's "
            "later stage when it holds several) are laid out in the "
            "order torch's schedule runs them on each rank, with the predicted per-stage "
            "times; grey gaps are bubbles. p2p transfers and the pipeline runtime's overhead "
            f"(pp_comm, {pp_comm * 1e3:.3f} ms) are not drawn: the drawing spans "
            f"{expl.timeline_s * 1e3:.3f} ms, the predicted step {expl.step_time_s * 1e3:.3f} ms."
        )
    else:
        caption = (
            "Approximate phases of one step on every rank (no pipeline): forward, backward, "
            "then the exposed communication and the optimizer, each drawn as one block of its "
            "predicted total (in the real step, collectives interleave with compute). "
            f"Predicted step {expl.step_time_s * 1e3:.3f} ms."
        )
    return fig, caption


def _memory(Figure, plan: Plan, expl: Explanation) -> tuple[Figure, str]:
    ranks = expl.rank_memory
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    ax = fig.add_subplot()
    peak = max(rm.memory.total for rm in ranks)
    cap = expl.capacity_bytes
    scale, unit = _byte_unit(max(peak, 1))
    x = list(range(len(ranks)))
    bottom = [0.0] * len(ranks)
    for kind, color in MEMORY_COLORS.items():
        values = [getattr(rm.memory, kind) / scale for rm in ranks]
        ax.bar(x, values, bottom=bottom, color=color, label=kind, width=0.6)
        bottom = [a + b for a, b in zip(bottom, values)]
    top = peak / scale * 1.2
    own = [rm.capacity_bytes for rm in ranks]
    if len(set(own)) > 1:  # a mixed cluster's pipeline: each rank against its group's memory
        for i, c in zip(x, own):
            ax.hlines(c / scale, i - 0.4, i + 0.4, color="#c03030", linestyle="--", linewidth=1.2)
        top = max(top, max(own) / scale * 1.08)
    elif cap / scale <= top * 1.6:
        ax.axhline(cap / scale, color="#c03030", linestyle="--", linewidth=1.2)
        ax.text(-0.45, cap / scale, f"device capacity {cap / 2**30:.1f} GiB", ha="left",
                va="bottom", color="#c03030", fontsize=8)  # fmt: skip
        top = max(top, cap / scale * 1.08)
    else:
        ax.text(0.99, 0.97, f"device capacity {cap / 2**30:.1f} GiB: far above "
                f"({peak / cap:.2%} used at the peak)", transform=ax.transAxes, ha="right",
                va="top", color="#c03030", fontsize=8)  # fmt: skip
    ax.set_ylim(0, top)
    ax.set_xticks(x, [f"rank {rm.rank}" for rm in ranks])
    ax.set_ylabel(unit)
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), fontsize=8, ncol=5, frameon=False)
    what = "pipeline rank" if plan.mesh.pp > 1 else "rank (all ranks alike without a pipeline)"
    against = (
        "its own group's device memory (dashed)"
        if len(set(own)) > 1
        else f"the device's {cap / 2**30:.1f} GiB"
    )
    caption = (
        f"Predicted memory per {what}, stacked by kind, against {against}; the fullest holds {peak / 2**20:.2f} MiB. Activations are those "
        "of the microbatches in flight at the rank's peak; buffers are DDP buckets, gathered "
        "FSDP units and reserves."
    )
    return fig, caption


def _alternatives(Figure, plan: Plan, expl: Explanation) -> tuple[Figure, str]:
    rows = [("chosen: " + _chosen_label(plan), expl.step_time_s, "chosen", True)]
    rows += [(a.label, a.step_time_s, a.lost_by, a.fits) for a in expl.alternatives]
    fig = Figure(figsize=(11, 1.0 + 0.38 * len(rows)), layout="constrained")
    ax = fig.add_subplot()
    longest = max((r[1] for r in rows if r[1]), default=expl.step_time_s) or 1e-9
    scale, unit = _time_unit(longest)
    colors = {"chosen": "#2a9d4a", "slower": "#4878d0", "idle_tp": "#9a9a9a",
              "pruned": "#a8c0e8", "memory": "#d65f5f", "constraint": "#d65f5f"}  # fmt: skip
    for i, (_, step, lost_by, fits) in enumerate(rows):
        y = len(rows) - 1 - i
        if step is None:
            ax.text(0, y, "  ruled out (see the explanation)", va="center", fontsize=8,
                    color="#c03030")  # fmt: skip
            continue
        hatch = "//" if lost_by == "pruned" or not fits else None
        ax.barh(y, step * scale, color=colors.get(lost_by, "#4878d0"), height=0.65,
                hatch=hatch, edgecolor="white")  # fmt: skip
        prefix = ">= " if lost_by == "pruned" else ""
        note = {"idle_tp": "  (TP shards nothing)", "memory": "  (does not fit)"}.get(lost_by, "")
        ax.text(step * scale, y, f" {prefix}{step * scale:.3g} {unit}{note}", va="center",
                fontsize=8)  # fmt: skip
    ax.set_yticks(range(len(rows)), [r[0] for r in reversed(rows)], fontsize=8)
    ax.set_xlim(0, longest * scale * 1.3)
    ax.set_xlabel(f"predicted step time ({unit})")
    caption = (
        "Predicted step time of the chosen plan (green) and the alternatives the search kept, "
        "best first. Grey: meshes whose TP group shards nothing (ranked last); hatched: a lower "
        "bound (pruned) or a plan that does not fit; red text: ruled out by a constraint."
    )
    return fig, caption


def _chosen_label(plan: Plan) -> str:
    s = plan.schedule
    if plan.mesh.pp == 1:
        return plan.mesh.short()
    return f"{plan.mesh.short()} {s.name} x{s.num_microbatches}"


# -- helpers -----------------------------------------------------------------------------------


def _patch(color: str, label: str):
    from matplotlib.patches import Patch

    return Patch(facecolor=color, label=label)


def _lighter(color: str, amount: float = 0.45) -> str:
    """``color`` (#rrggbb) blended toward white."""
    rgb = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def _byte_unit(num_bytes: float) -> tuple[float, str]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return float(scale), unit
    return 1.0, "bytes"


def _metadata(fmt: str) -> dict:
    return {"Date": None} if fmt == "svg" else {}


def _svg(fig, salt: str) -> str:
    """The figure as an inline <svg> element (no XML prolog, DOCTYPE or RDF metadata), its
    element ids salted per figure so two figures on one page cannot collide."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": salt, "svg.fonttype": "path"}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata=_metadata("svg"))
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    return text


_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto;
       max-width: 1150px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 12px; }
figure { margin: 0; } figure svg { max-width: 100%; height: auto; }
figcaption { font-size: 0.9em; color: #555; margin-top: 0.3em; }
"""
