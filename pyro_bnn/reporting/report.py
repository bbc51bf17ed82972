"""Report of a guide comparison: tables, JSON and PNG figures a person wants to look at.

:func:`write_report` writes, for a :class:`~pyro_bnn.reporting.comparison.Comparison`:

* ``table.md`` / ``table.csv`` — the comparison table;
* ``metrics.json`` — every metric, per-epoch training history, each fit's convergence diagnosis
  (``FitResult.convergence``: verdict, reasons, measures), OOD scores, settings;
* ``reliability.png`` — reliability diagrams (accuracy vs confidence, ECE) per guide;
* ``entropy.png`` — predictive entropy on test data vs out-of-distribution inputs (rotated
  digits, uniform noise) per guide, with the AUROC of entropy as an OOD detector;
* ``forest.png`` — ArviZ forest plot of selected weights across guides;
* ``regression.png`` — predictive bands (regression data instead of the two above);
* ``datatrees/<guide>.nc`` — each guide's ArviZ ``DataTree`` (``xarray.open_datatree``).

* ``index.html`` — the table and every figure on one page (plain HTML, relative image links);
* ``README.md`` — what the folder is: complete, or ``PARTIAL`` / ``FAILED`` and why;
* ``.pyro-bnn-report`` — the marker (program, version, time, status, the files written).

The folder is written whole or not at all (:class:`StagedFolder`): the files go into a
temporary sibling folder that replaces ``out`` only at the end, so an interrupted or failed
run leaves the previous report as it was, and a rerun leaves no file of the previous one.
Only a folder this program wrote (with its marker, and no file added since) or an empty or
new folder is ever replaced; any other folder is refused before any work is done.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from .._version import __version__
from ..analysis.ood import auroc
from ..model.devices import module_device
from ..posterior import metrics
from ..posterior.prediction import binary_labels
from .comparison import class_probabilities
from .loo_columns import loo_reliability_note
from .staged_folder import StagedFolder

__all__ = ["write_report", "StagedFolder", "ood_inputs", "reliability_figure", "entropy_figure", "forest_figure",
           "regression_figure", "markdown_table", "index_html"]


def _plt():
    import matplotlib

    if "MPLBACKEND" not in os.environ:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(n: int, height: float = 3.6):
    """A figure of ``n`` panels, at most 3 per row (spare panels hidden): ``(fig, axes)``."""
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, grid = _plt().subplots(rows, cols, figsize=(4.2 * cols, height * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[n:]:
        ax.axis("off")
    return fig, axes[:n]


def _finish(fig, title: str):
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def markdown_table(df, floatfmt: str = ".4g") -> str:
    """A pandas DataFrame as a GitHub Markdown table (no ``tabulate`` needed)."""
    cols = [df.index.name or ""] + [str(c) for c in df.columns]

    def fmt(v):
        if isinstance(v, (float, np.floating)):
            return "" if math.isnan(v) else format(float(v), floatfmt)
        return "" if v is None else str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for idx, row in df.iterrows():
        lines.append("| " + " | ".join([str(idx)] + [fmt(v) for v in row.tolist()]) + " |")
    return "\n".join(lines) + "\n"


def ood_inputs(x: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    """Out-of-distribution versions of image inputs ``x`` ``(N, D)`` or ``(N, C, H, W)``.

    ``"rotated 90°"``: every image rotated by a quarter turn (square images only);
    ``"uniform noise"``: pixels drawn from ``U(min x, max x)``.
    """
    g = torch.Generator().manual_seed(seed)
    lo, hi = float(x.min()), float(x.max())
    out = {"uniform noise": lo + (hi - lo) * torch.rand(x.shape, generator=g, dtype=x.dtype)}
    side = math.isqrt(x.shape[-1]) if x.dim() == 2 else None
    if x.dim() == 2 and side * side == x.shape[-1]:
        out["rotated 90°"] = torch.rot90(x.reshape(-1, side, side), 1, (1, 2)).reshape(x.shape)
    elif x.dim() == 4 and x.shape[-1] == x.shape[-2]:
        out["rotated 90°"] = torch.rot90(x, 1, (2, 3))
    return dict(sorted(out.items(), reverse=True))


def reliability_figure(probs: Mapping[str, torch.Tensor], y: torch.Tensor, num_bins: int = 15):
    """Reliability diagram per guide: bin accuracy vs confidence of the model average.

    ``probs`` maps a guide name to ``(S, N, C)`` predictive samples.
    """
    fig, axes = _panels(len(probs), height=4.0)
    width = 1.0 / num_bins
    centers = (torch.arange(num_bins, dtype=torch.float64) + 0.5) * width
    for ax, (name, p) in zip(axes, probs.items()):
        mean = p.mean(0)
        conf, acc, count = metrics.calibration_bins(mean, y.to(mean.device), num_bins=num_bins)
        conf, acc, count = conf.cpu(), acc.cpu(), count.cpu()
        ece = metrics.expected_calibration_error(mean, y.to(mean.device), num_bins=num_bins)
        filled = count > 0
        ax.bar(centers[filled].numpy(), acc[filled].numpy(), width=width, edgecolor="black", color="tab:blue",
               alpha=0.8, label="accuracy in bin")
        lo = torch.minimum(conf, acc)
        ax.bar(centers[filled].numpy(), (conf - acc).abs()[filled].numpy(), bottom=lo[filled].numpy(), width=width,
               fill=False, edgecolor="tab:red", hatch="//", label="gap to mean confidence")
        share = count / count.sum()
        ax.bar(centers[filled].numpy(), (share[filled] * 0.25).numpy(), width=0.35 * width, color="0.3",
               zorder=3, label="share of examples (×0.25)")
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (max predictive probability)",
               ylabel="accuracy", title=f"{name}: ECE = {ece:.3f}")
        ax.legend(loc="upper left", fontsize=8)
    return _finish(fig, "Reliability diagrams (test set, posterior predictive)")


def _auroc(in_scores, out_scores) -> float:
    """AUROC of separating ``out_scores`` (positives) from ``in_scores`` (:func:`pyro_bnn.analysis.ood.auroc`)."""
    scores = torch.as_tensor(np.r_[in_scores, out_scores], dtype=torch.float64)
    labels = torch.cat([torch.zeros(len(in_scores)), torch.ones(len(out_scores))]).bool()
    return auroc(scores, labels)


def entropy_figure(entropies: Mapping[str, Mapping[str, np.ndarray]], num_classes: int):
    """Histograms of predictive entropy per guide: test data vs each OOD set.

    ``entropies[guide][set]`` are per-input entropies (nats); the first set is in-distribution.
    Each panel's title gives the AUROC of entropy as a detector of each OOD set.
    Returns ``(figure, {guide: {ood_set: AUROC}})``.
    """
    fig, axes = _panels(len(entropies))
    bins = np.linspace(0, math.log(num_classes), 31)
    aurocs = {}
    for ax, (name, sets) in zip(axes, entropies.items()):
        keys = list(sets)
        aurocs[name] = {k: _auroc(sets[keys[0]], sets[k]) for k in keys[1:]}
        for k in keys:
            label = k if k == keys[0] else f"{k} (AUROC {aurocs[name][k]:.2f})"
            ax.hist(sets[k], bins=bins, alpha=0.5, density=True, label=label)
        scores = "".join(f"\nAUROC {k}: {v:.3f}" for k, v in aurocs[name].items())
        ax.set(xlabel="predictive entropy H[p̄] (nats)", ylabel="density", title=name + scores)
        ax.legend(fontsize=8)
    return _finish(fig, "Predictive entropy: in-distribution vs out-of-distribution"), aurocs


def _forest_selection(dts: Mapping[str, object]):
    """Output-layer bias and the output weights from hidden unit 0, of the guides sharing them.

    Sites differ between parametrisations (a weight-norm model has ``weight_g`` sites), so
    the site shared by most guides wins; guides without it are left out of the plot.
    """
    counts: dict[str, int] = {}
    order: list[str] = []
    for dt in dts.values():
        for v in dt["posterior"].data_vars:
            counts[v] = counts.get(v, 0) + 1
            if v not in order:
                order.append(v)
    if not order:
        return [], {}
    best = max(counts.values())
    candidates = [v for v in order if counts[v] == best]
    first = next(dt for dt in dts.values() if candidates[0] in dt["posterior"].data_vars)["posterior"]
    # on a tie between parametrisations (e.g. one weight-norm and one plain guide), the sites of one
    candidates = [v for v in candidates if v in first.data_vars]
    vectors = [v for v in candidates if first[v].ndim == 3]
    last = vectors[-1] if vectors else candidates[-1]
    layer = last.rsplit(".", 1)[0]
    chosen, coords = [last], {}
    weight = f"{layer}.weight"
    if weight in candidates and weight != last and f"{layer}.in" in first[weight].dims:
        chosen.append(weight)
        coords[f"{layer}.in"] = [0]
    for v in chosen:  # at most 10 entries along each remaining dim
        for dim in first[v].dims[2:]:
            if dim not in coords and first.sizes[dim] > 10:
                coords[dim] = list(range(10))
    return chosen, coords


def forest_figure(datatrees: Mapping[str, object], var_names=None, coords=None):
    """ArviZ forest plot (50% and 89% equal-tailed intervals) of selected weights per guide.

    By default: the output-layer bias and the output weights from hidden unit 0 of the
    guides that share those sites.  Returns ``(figure, var_names, guides_shown)`` or
    ``(None, [], [])`` when no site is common.
    """
    import arviz_plots

    _plt()
    if var_names is None:
        var_names, coords = _forest_selection(datatrees)
    if not var_names:
        return None, [], []
    shown = {k: v for k, v in datatrees.items() if all(n in v["posterior"].data_vars for n in var_names)}
    pc = arviz_plots.plot_forest(shown, var_names=list(var_names), coords=coords or None,
                                 combined=True, backend="matplotlib", ci_probs=(0.5, 0.89))
    pc.add_legend("model", title="guide")
    fig = pc.viz["figure"].item()
    fig.axes[-1].set_xlabel("weight value")
    title = "Posterior of selected weights: point = mean, thick = 50%, thin = 89% interval"
    missing = [k for k in datatrees if k not in shown]
    if missing:
        title += f"\n(not shown, other parameter sites: {', '.join(missing)})"
    fig.suptitle(title)
    return fig, list(var_names), list(shown)


def regression_figure(runs: Mapping[str, object], split, num_samples: int = 100):
    """Predictive mean ± 2 sd per guide on a grid wider than the training inputs (1-D x)."""
    x_tr, y_tr = split.x_train.cpu(), split.y_train.cpu()
    lo, hi = float(x_tr.min()), float(x_tr.max())
    pad = hi - lo
    grid = torch.linspace(lo - pad, hi + pad, 200).unsqueeze(-1)
    fig, axes = _panels(len(runs))
    for ax, (name, run) in zip(axes, runs.items()):
        out = run.predictive(grid.to(module_device(run.model)), num_samples)
        loc, scale = out.loc.cpu()[..., 0], out.scale.cpu()[..., 0]
        mean = loc.mean(0)
        sd = (loc.var(0, unbiased=False) + (scale ** 2).mean(0)).sqrt()
        g = grid[:, 0]
        ax.fill_between(g.numpy(), (mean - 2 * sd).numpy(), (mean + 2 * sd).numpy(), alpha=0.3, label="±2 sd")
        ax.plot(g.numpy(), mean.numpy(), label="predictive mean")
        ax.scatter(x_tr[:, 0].numpy(), y_tr[:, 0].numpy(), s=8, c="k", label="training data")
        ax.set(xlabel="x", ylabel="y", title=name)
        ax.legend(fontsize=8)
    return _finish(fig, "Posterior predictive (uncertainty should grow away from the data)")


def _jsonable(v):
    if isinstance(v, (bool, np.bool_)):  # before int: bool is an int subclass
        return bool(v)
    if isinstance(v, (float, np.floating)):
        return None if math.isnan(float(v)) else float(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v if v is None or isinstance(v, (str, bool)) else str(v)


#: Report statuses: every guide ran; interrupted (only the guides that finished); every guide failed.
STATUSES = ("complete", "partial", "failed")


def write_report(comparison, out: str | os.PathLike, *, num_samples: int = 100,
                 settings: Mapping | None = None, staged: bool = True, status: str = "complete",
                 note: str | None = None, ood: Mapping[str, torch.Tensor] | None = None,
                 ood_note: str | None = None) -> dict[str, Path]:
    """Write the report folder for a :class:`~pyro_bnn.reporting.comparison.Comparison`.

    Parameters
    ----------
    comparison : Comparison
        ``pb.compare(..., details=True)``.
    out : path
        Folder: new, empty, or an earlier report of this program (with its marker and no file
        added since), which is replaced as a whole; any other folder is refused
        (:class:`~pyro_bnn.reporting.staged_folder.NotAReportFolder`) and left as it was.
    num_samples : int
        Posterior draws for the OOD predictive.
    settings : dict, optional
        Stored under ``"settings"`` in ``metrics.json``.
    staged : bool
        Write into a temporary sibling of ``out`` and swap it into place at the end
        (:class:`StagedFolder`; default).  ``False`` writes into ``out`` directly, for a
        caller that stages the folder itself (and writes the marker at its commit).
    status : {"complete", "partial", "failed"}
        What the report is; a ``partial`` or ``failed`` one says so at the top of
        ``README.md`` and ``table.md`` (with ``note``), in ``metrics.json`` and in the marker.
    note : str, optional
        One line on why (e.g. ``"interrupted after guides meanfield"``).
    ood : dict, optional
        ``{name: inputs}``: the out-of-distribution sets of ``entropy.png`` (e.g. MNIST digits
        for a Fashion-MNIST model); ``None`` (default): :func:`ood_inputs` of the test inputs;
        ``{}``: no OOD figure (say why in ``ood_note``).
    ood_note : str, optional
        Shown in ``index.html`` and ``metrics.json`` (e.g. why there is no OOD figure).

    Returns
    -------
    dict[str, Path]
        The artefacts written, by kind.
    """
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    if not staged:
        return _write_files(comparison, Path(out), num_samples=num_samples, settings=settings,
                            status=status, note=note, ood=ood, ood_note=ood_note)
    folder = StagedFolder(out)
    try:
        written = _write_files(comparison, folder.path, num_samples=num_samples, settings=settings,
                               status=status, note=note, ood=ood, ood_note=ood_note)
        folder.commit(status=status, info=report_info(comparison, note))
    finally:
        folder.discard()
    return {k: folder.out / p.relative_to(folder.path) for k, p in written.items()}


def report_info(comparison, note: str | None = None) -> dict:
    """What the marker records besides the program: the guides that ran, failed, and why."""
    runs = comparison.runs
    return {"guides": [k for k, r in runs.items() if r.error is None],
            "failed_guides": [k for k, r in runs.items() if r.error is not None],
            **({"note": note} if note else {})}


def _headline(status: str, note: str | None) -> str:
    """The first line of a partial or failed report (empty for a complete one)."""
    if status == "complete":
        return ""
    return f"**{status.upper()}: {note or status}**\n\n"


def _readme(comparison, status: str, note: str | None, files) -> str:
    info = report_info(comparison, note)
    lines = [f"# pyro-bnn report ({status})", ""]
    if status != "complete":
        lines += [_headline(status, note).strip(), ""]
    lines += [f"Written by pyro-bnn {__version__}.", "",
              f"- guides with results: {', '.join(info['guides']) or 'none'}"]
    if info["failed_guides"]:
        lines.append(f"- failed guides (errors in metrics.json): {', '.join(info['failed_guides'])}")
    lines += ["- files: " + ", ".join(sorted(files)), ""]
    loo_note = loo_reliability_note(comparison.table)
    if loo_note:
        lines += [loo_note, ""]
    return "\n".join(lines)


def _write_files(comparison, out: Path, *, num_samples: int, settings: Mapping | None,
                 status: str = "complete", note: str | None = None, ood=None,
                 ood_note: str | None = None) -> dict[str, Path]:
    plt = _plt()
    out = Path(out)
    (out / "datatrees").mkdir(parents=True, exist_ok=True)
    table = comparison.table
    ok = {k: r for k, r in comparison.runs.items() if r.error is None and r.model is not None}
    written: dict[str, Path] = {}
    loo_note = loo_reliability_note(table)
    (out / "table.md").write_text(_headline(status, note) + markdown_table(table)
                                  + (f"\n\n{loo_note}\n" if loo_note else ""))
    table.to_csv(out / "table.csv")
    written.update(table_md=out / "table.md", table_csv=out / "table.csv")
    extra: dict = {}
    split = comparison.data
    classification = bool(ok) and next(iter(ok.values())).scale is None
    if ok and classification:
        labels = split.y_test.cpu()
        labels = binary_labels(labels) if labels.is_floating_point() else labels  # Bernoulli's 0/1
        fig = reliability_figure({k: r.probs for k, r in ok.items()}, labels)
        fig.savefig(out / "reliability.png", dpi=110)
        plt.close(fig)
        written["reliability"] = out / "reliability.png"
        oods = ood_inputs(split.x_test.cpu()) if ood is None else dict(ood)
        entropies = {}
        for name, run in ok.items() if oods else ():
            sets = {"test data": metrics.predictive_entropy(run.probs).numpy()}
            for k, xo in oods.items():
                po = class_probabilities(run.predictive(xo.to(module_device(run.model)), num_samples)).cpu()
                sets[k] = metrics.predictive_entropy(po).cpu().numpy()
            entropies[name] = sets
        if entropies:
            fig, aurocs = entropy_figure(entropies, next(iter(ok.values())).probs.shape[-1])
            fig.savefig(out / "entropy.png", dpi=110)
            plt.close(fig)
            written["entropy"] = out / "entropy.png"
            extra["ood_auroc_entropy"] = aurocs
            extra["mean_entropy"] = {k: {s: float(np.mean(v)) for s, v in sets.items()}
                                     for k, sets in entropies.items()}
    elif ok:
        fig = regression_figure(ok, split, num_samples)
        fig.savefig(out / "regression.png", dpi=110)
        plt.close(fig)
        written["regression"] = out / "regression.png"
    if ood_note:
        extra["ood_note"] = ood_note
    dts = comparison.datatrees
    if dts:
        fig, names, shown = forest_figure(dts)
        if fig is not None:
            fig.savefig(out / "forest.png", dpi=110)
            plt.close(fig)
            written["forest"] = out / "forest.png"
            extra["forest"] = {"var_names": names, "guides": shown}
        for name, dt in dts.items():
            path = out / "datatrees" / f"{name}.nc"
            dt.to_netcdf(path)
            written[f"datatree_{name}"] = path
    payload = {
        "status": status,
        **({"note": note} if note else {}),
        "settings": dict(settings or {}),
        "table": {name: row for name, row in table.to_dict(orient="index").items()},
        "history": {k: r.fit.history for k, r in comparison.runs.items() if r.fit is not None},
        "convergence": {k: {"converged": r.fit.convergence.converged, "reasons": r.fit.convergence.reasons,
                            "measures": r.fit.convergence.measures}
                        for k, r in comparison.runs.items()
                        if r.fit is not None and r.fit.convergence is not None},
        "errors": {k: r.error for k, r in comparison.runs.items() if r.error is not None},
        **extra,
    }
    (out / "metrics.json").write_text(json.dumps(_jsonable(payload), indent=2))
    written["metrics_json"] = out / "metrics.json"
    figures = [p.name for k, p in written.items() if p.suffix == ".png"]
    (out / "index.html").write_text(index_html(table, figures, status=status, note=note,
                                               ood_note=ood_note))
    written["index_html"] = out / "index.html"
    names = [p.relative_to(out).as_posix() for p in written.values()] + ["README.md"]
    (out / "README.md").write_text(_readme(comparison, status, note, names))
    written["readme"] = out / "README.md"
    return written


#: Captions of the report's figures in ``index.html``.
FIGURE_CAPTIONS = {
    "reliability.png": "Reliability diagrams: accuracy against confidence on the test set.",
    "entropy.png": "Predictive entropy on in-distribution test inputs against out-of-distribution "
                   "inputs; AUROC of entropy as an OOD detector in each panel title.",
    "forest.png": "Posterior of selected weights per guide.",
    "regression.png": "Posterior predictive bands.",
}


def _html_cell(value, floatfmt: str = ".4g") -> str:
    import html

    if isinstance(value, (float, np.floating)):
        return "" if math.isnan(value) else format(float(value), floatfmt)
    return html.escape("" if value is None else str(value))


def index_html(table, figures, *, status: str = "complete", note: str | None = None,
               ood_note: str | None = None) -> str:
    """The report's one page: headline, the comparison table and every figure.

    Plain HTML with inline CSS and relative image links (no external resources).

    Parameters
    ----------
    table : pandas.DataFrame
        The comparison table (one row per guide).
    figures : list of str
        File names of the figures, relative to the report folder.
    status, note, ood_note : str
        The report's status and notes (shown at the top).

    Returns
    -------
    str
    """
    import html

    head = [f"<th>{html.escape(str(table.index.name or 'guide'))}</th>"]
    head += [f"<th>{html.escape(str(c))}</th>" for c in table.columns]
    rows = []
    for idx, row in table.iterrows():
        cells = [f"<th scope='row'>{html.escape(str(idx))}</th>"]
        cells += [f"<td{'' if isinstance(v, (int, float, np.number)) else ' class=t'}>{_html_cell(v)}</td>"
                  for v in row.tolist()]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    notes = []
    if status != "complete":
        notes.append(f"<p class='warn'><b>{status.upper()}: {html.escape(note or status)}</b></p>")
    if ood_note:
        notes.append(f"<p class='note'>{html.escape(ood_note)}</p>")
    loo_note = loo_reliability_note(table)
    if loo_note:
        notes.append(f"<p class='note'>{html.escape(loo_note)}</p>")
    body = [f"<figure><img src='{html.escape(f)}' alt='{html.escape(f)}'>"
            f"<figcaption>{html.escape(FIGURE_CAPTIONS.get(f, f))}</figcaption></figure>" for f in figures]
    style = ("body{font-family:sans-serif;margin:1.5em;max-width:1400px}"
             "table{border-collapse:collapse;font-size:12px}"
             "th,td{border:1px solid #bbb;padding:3px 6px;text-align:right;vertical-align:top}"
             "td.t{text-align:left;min-width:9em;max-width:28em}"
             "thead th{background:#eee;position:sticky;top:0}"
             ".scroll{overflow-x:auto}img{max-width:100%;height:auto;border:1px solid #ddd}"
             "figure{margin:1.5em 0}.warn{color:#a00}.note{color:#555}")
    return "\n".join([
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
        f"<title>pyro-bnn report ({html.escape(status)})</title><style>{style}</style></head><body>",
        f"<h1>pyro-bnn report ({html.escape(status)})</h1>",
        f"<p>Written by pyro-bnn {html.escape(str(__version__))}. Compare <code>bound</code> only between "
        "rows of the same <code>bound_kind</code>.</p>", *notes,
        "<h2>Comparison</h2>", "<div class='scroll'><table>",
        f"<thead><tr>{''.join(head)}</tr></thead>", f"<tbody>{''.join(rows)}</tbody>", "</table></div>",
        "<h2>Figures</h2>", *body, "</body></html>", ""])

