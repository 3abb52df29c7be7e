"""The demo's and the replay study's reporting: per-arm mean and spread over seeds, the results
table, and accuracy plotted against generated tokens or total compute."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchreplay.demo.runner import DemoConfig

_BUFFER_HIGHLIGHTS = (
    "reuse_mean", "age_mean", "age_max", "ess_fraction", "evicted_staleness", "evicted_reuse", "evicted_capacity",
    "sampled_fresh", "sampled_replay", "stale_handle_updates", "size", "storage_hot_hits", "storage_cold_reads",
    "storage_spilled_shards",
)


def mean_spread(values: list[float | None]) -> dict[str, Any]:
    got = [v for v in values if v is not None]
    if not got:
        return {"mean": None, "min": None, "max": None, "std": None, "n": 0, "of": len(values)}
    t = torch.tensor(got, dtype=torch.float64)
    std = float(t.std()) if len(got) > 1 else 0.0
    return {"mean": float(t.mean()), "min": float(t.min()), "max": float(t.max()), "std": std, "n": len(got),
            "of": len(values)}


def summarize(results: dict[int, dict[str, dict[str, Any]]], cfg: DemoConfig) -> dict[str, Any]:
    """Per-arm mean and spread over seeds, and the replay arms' token saving versus on-policy.

    ``token_saving`` is ``1 - tokens_to_target(arm) / tokens_to_target(on-policy)`` per seed (a fraction;
    0.5 means half the generated tokens), defined only where both reached the target.
    """
    names = [a.name for a in cfg.arms]
    base = names[0]
    out: dict[str, Any] = {}
    for name in names:
        runs = [results[s][name] for s in results]
        entry: dict[str, Any] = {
            "tokens_to_target": mean_spread([r["tokens_to_target"] for r in runs]),
            "final_acc": mean_spread([r["final_acc"] for r in runs]),
            "entropy": mean_spread([r["entropy"] for r in runs]),
            "wall_s": mean_spread([r["wall_s"] for r in runs]),
            "generated_tokens": mean_spread([r["generated_tokens"] for r in runs]),
            "trained_rollouts": mean_spread([r["trained_rollouts"] for r in runs]),
            "trained_tokens": mean_spread([r["trained_tokens"] for r in runs]),
            "compute": mean_spread([r["compute"] for r in runs]),
            "compute_to_target": mean_spread([compute_to_target(r, cfg) for r in runs]),
            "uses_per_rollout": mean_spread([r["uses_per_rollout"] for r in runs]),
        }
        if name != base:
            savings = []
            for s in results:
                mine, theirs = results[s][name]["tokens_to_target"], results[s][base]["tokens_to_target"]
                savings.append(None if mine is None or theirs is None else 1.0 - mine / theirs)
            entry["token_saving"] = mean_spread(savings)
        if "buffer_metrics" in runs[0]:
            entry["buffer"] = {
                k: mean_spread([r["buffer_metrics"].get(k) for r in runs])["mean"]
                for k in _BUFFER_HIGHLIGHTS
                if k in runs[0]["buffer_metrics"]
            }
        out[name] = entry
    return out


def compute_to_target(run: dict[str, Any], cfg: DemoConfig) -> float | None:
    """Total compute (trained-token units) spent when the run first reached the target accuracy;
    None if it never did."""
    return next((c for c, a in run["compute_curve"] if a >= cfg.target_acc), None)


def _fmt(stat: dict[str, Any], scale: float = 1.0, digits: int = 3, unit: str = "") -> str:
    if stat["mean"] is None:
        return "not reached"
    text = f"{stat['mean'] / scale:.{digits}f}{unit}"
    if stat["of"] > 1:
        text += f" ±{stat['std'] / scale:.{digits}f}"
        if stat["n"] < stat["of"]:
            text += f" ({stat['n']}/{stat['of']} reached)"
    return text


def format_table(summary: dict[str, Any], cfg: DemoConfig) -> str:
    """The printed results table (one row per arm; ± is the std over seeds)."""
    rows = [["arm", f"tokens to {cfg.target_acc:.0%}", "saving", f"compute to {cfg.target_acc:.0%}", "final acc",
             "trained tok", "entropy", "wall", "uses/rollout", "age mean/max", "evicted stale/reuse",
             "IS weight ESS", "tier hits hot/cold"]]
    for name, e in summary.items():
        b = e.get("buffer", {})
        saving = _fmt(e["token_saving"], 0.01, 0, "%") if "token_saving" in e else "-"
        rows.append([
            name,
            _fmt(e["tokens_to_target"], 1e3, 0, "K"),
            saving,
            _fmt(e["compute_to_target"], 1e3, 0, "K"),
            _fmt(e["final_acc"]),
            _fmt(e["trained_tokens"], 1e3, 0, "K"),
            _fmt(e["entropy"], digits=3),
            _fmt(e["wall_s"], digits=0, unit="s"),
            _fmt(e["uses_per_rollout"], digits=2),
            f"{b['age_mean']:.1f}/{b['age_max']:.0f}" if "age_mean" in b else "-",
            f"{b['evicted_staleness']:.0f}/{b['evicted_reuse']:.0f}" if "evicted_staleness" in b else "-",
            # The last batch's effective sample size as a fraction of it: how far the weights are from flat.
            f"{b['ess_fraction']:.2f}" if b.get("ess_fraction") is not None and "age_mean" in b else "-",
            f"{b['storage_hot_hits']:.0f}/{b['storage_cold_reads']:.0f}" if "storage_hot_hits" in b else "-",
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(results: dict[int, dict[str, dict[str, Any]]], cfg: DemoConfig, path: Path, x: str = "tokens") -> None:
    """Accuracy versus generated tokens (`x="tokens"`) or total compute (`x="compute"`) per arm
    (mean over seeds, shaded min-max) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    key = "curve" if x == "tokens" else "compute_curve"
    end = max(results[s][arm.name][key][-1][0] for s in results for arm in cfg.arms)
    grid = np.linspace(0, end, 61)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for arm in cfg.arms:
        ys = []
        for s in results:
            curve = np.asarray(results[s][arm.name][key], dtype=np.float64)
            ys.append(np.interp(grid, curve[:, 0], curve[:, 1], right=np.nan))
        y = np.stack(ys)
        with warnings.catch_warnings():
            # Past the end of every seed's curve there is no value: NaN, not drawn.
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, low, high = np.nanmean(y, axis=0), np.nanmin(y, axis=0), np.nanmax(y, axis=0)
        (line,) = ax.plot(grid / 1e3, mean, label=arm.name, lw=2)
        if len(ys) > 1:
            ax.fill_between(grid / 1e3, low, high, color=line.get_color(), alpha=0.2)
    ax.axhline(cfg.target_acc, color="grey", ls="--", lw=1, label=f"target {cfg.target_acc:.0%}")
    ax.set_xlabel("generated tokens (thousands)" if x == "tokens" else
                  f"total compute (thousands of trained-token units; a generated token = {cfg.gen_cost_per_token:.2f})")
    ax.set_ylabel("exact-match accuracy (greedy, held-out)")
    n = len(results)
    what = "digit sorting" if cfg.task == "sort" else f"reasoning-gym arithmetic ({cfg.num_terms} terms)"
    ax.set_title(f"GRPO on {what}: on-policy vs torchreplay ({n} seed{'s' if n > 1 else ''})")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
