"""Markdown table of the JSON lines ``benchmarks/fashion_mnist.py --out`` writes.

    python benchmarks/fashion_mnist_table.py runs/map60k.jsonl runs/invest10k.jsonl
"""

from __future__ import annotations

import json
import sys


def _f(v, digits=4):
    return "–" if v is None else f"{v:.{digits}f}"


def settings(r: dict) -> str:
    parts = [r["row"]]
    if r["row"] == "meanfield":
        for key, default in (("prior_scale", 1.0), ("kl_weight", 1.0), ("init_scale", None)):
            if r.get(key) != default:
                parts.append(f"{key}={r[key]}")
        if r.get("lr") not in (None, 0.05):
            parts.append(f"lr={r['lr']}")
    if r["row"] in ("map", "ensemble") and r.get("weight_decay") is not None:
        parts.append(f"wd={r['weight_decay']:.2g}")
    return " ".join(parts)


def conv(r: dict) -> str:
    c = r.get("convergence")
    if isinstance(c, list):
        c = c[0]
    if not c:
        return "–"
    gain = c.get("objective_gain")
    gain = "" if gain is None else f" (gain {gain:+.2e} ± {c.get('objective_gain_se') or 0:.1e})"
    return ("converged" if c["converged"] else "NOT converged") + gain


def lines(rows) -> list[str]:
    out = ["| row | N train | epochs | acc | NLL | ECE | Brier | AUROC H | AUROC MI | ELBO / evidence | "
           "s/epoch | diagnosis |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        subs = [("", r)] if "accuracy" in r else []
        subs += [(f" {k}", r[k]) for k in ("map_55k", "delta_by_evidence", "delta_by_validation") if k in r]
        for label, m in subs:
            ev = m.get("log_evidence", r.get("elbo_full_data"))
            out.append(f"| {settings(r)}{label} | {r['num_train']} | {r['epochs']} | {_f(m['accuracy'])} | "
                       f"{_f(m['nll'])} | {_f(m['ece'])} | {_f(m['brier'])} | {_f(m['ood_auroc_entropy'], 3)} | "
                       f"{_f(m.get('ood_auroc_mi'), 3)} | {_f(ev, 0)} | {_f(r['seconds_per_epoch'], 1)} | "
                       f"{conv(r)} |")
    return out


def main(paths):
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    print("\n".join(lines(rows)))


if __name__ == "__main__":
    main(sys.argv[1:])
