"""The online-selection benchmark's code paths without engines: plan, summary, markdown, plot."""

from __future__ import annotations

import json

from benchmarks import online_selection as bench


def test_dry_run_prints_the_plan(capsys):
    assert bench.main(["--dry-run"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert set(p["methods"]) == {"plain", "online", "profile"}
    online = p["methods"]["online"]
    assert online["layer_selection"] == "online" and "profile" not in online  # cold start
    assert p["methods"]["profile"]["profile"] == bench.SMOLLM2_PROFILE


def _fake_results():
    def rounds(acc, tps, online=None):
        out, cum = [], 0
        for i, (a, t) in enumerate(zip(acc, tps, strict=True)):
            cum += 100
            row = {"round": i, "tokens": 100, "cum_tokens": cum, "wall_s": 100 / t,
                   "tokens_per_s": t, "drafted": 0 if a is None else 100,
                   "accepted": 0 if a is None else int(100 * a), "acceptance": a,
                   "output_ids": [[1, 2, i]]}
            if online is not None:
                row["online"] = online(i)
            out.append(row)
        return out

    def state(i):
        return {"state": "converged" if i >= 2 else "searching", "passes": 10 * i,
                "skip_attention": [3], "skip_mlp": [], "matchness": 0.9, "overhead_s": 1.5,
                "converged_reason": "60 passes without improvement" if i >= 2 else None}

    args = bench.parse_args([])
    p = bench.plan(args)
    results = {
        "plain": {"name": "plain", "spec": None, "rounds": rounds([None] * 4, [50] * 4),
                  "tokens": 400, "wall_s": 8.0, "tokens_per_s": 50.0},
        "online": {"name": "online", "spec": p["methods"]["online"],
                   "rounds": rounds([0.3, 0.5, 0.8, 0.9], [40, 45, 50, 52], state),
                   "tokens": 400, "wall_s": 10.0, "tokens_per_s": 40.0},
        "profile": {"name": "profile", "spec": p["methods"]["profile"],
                    "rounds": rounds([0.95] * 4, [49] * 4), "tokens": 400, "wall_s": 8.2,
                    "tokens_per_s": 48.8},
    }
    return p, results


def test_summary_markdown_and_plot(tmp_path):
    p, results = _fake_results()
    s = bench.summarize(results)
    assert s["online"]["tokens_until_convergence"] == 300
    assert s["online"]["overhead_share"] == 0.15
    assert s["online"]["final_acceptance"] == 0.9
    assert s["profile"]["final_acceptance"] == 0.95
    assert s["online"]["speed_vs_plain"] == 0.8
    assert s["online"]["outputs_equal_plain"] is True
    doc = {"plan": p, "host": {"cpus": 2}, "results": results, "summary": s}
    md = bench.render_markdown(doc)
    assert "tokens until convergence: 300" in md and "| online | 400 |" in md
    png = tmp_path / "x.png"
    bench.plot(doc, png)
    assert png.stat().st_size > 1000
