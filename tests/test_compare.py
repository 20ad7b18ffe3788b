"""pairmine compare: paired per-query comparison on small result files whose numbers can be checked by hand."""

import json

import numpy as np
import pytest

from pairmine.pipeline.cli import main
from pairmine.pipeline.evaluate import (
    EvalInputError,
    compare_results,
    load_per_query,
    paired_bootstrap,
    sign_flip_p_value,
    verdict,
)


def result(tmp_path, name: str, ndcg: dict, **extra) -> str:
    d = tmp_path / name
    d.mkdir()
    queries = {q: {"ndcg@10": v, "recall@100": 1.0, "mrr@10": v} for q, v in ndcg.items()}
    (d / "per_query.json").write_text(json.dumps({"format": "pairmine-eval-per-query/1", "model": name,
                                                  "queries": queries, **extra}))
    return str(d)


A = {"q1": 0.5, "q2": 0.2, "q3": 0.7, "q4": 0.0}
B = {"q1": 0.6, "q2": 0.2, "q3": 0.4, "q4": 0.1}


def test_wins_ties_losses_and_mean_difference_by_hand(tmp_path):
    a, b = load_per_query(result(tmp_path, "a", A)), load_per_query(result(tmp_path, "b", B))
    comps, info = compare_results(a, b)
    assert [c.metric for c in comps] == ["ndcg@10", "recall@100", "mrr@10"] and info["queries_common"] == 4
    c = comps[0]
    # B - A per query: +0.1, 0, -0.3, +0.1 -> 2 wins, 1 tie, 1 loss; mean (0.1 + 0 - 0.3 + 0.1) / 4 = -0.025.
    assert (c.wins, c.ties, c.losses) == (2, 1, 1)
    assert c.mean_a == pytest.approx(0.35) and c.mean_b == pytest.approx(0.325)
    assert c.mean_diff == pytest.approx(-0.025)
    # The bootstrap means lie between the smallest and largest difference and the interval holds the mean.
    assert -0.3 <= c.ci_low <= -0.025 <= c.ci_high <= 0.1
    # Sign flips of (0.1, 0, -0.3, 0.1): the smallest |sum| is 0.3 - 0.1 - 0.1 = 0.1, i.e. |mean| 0.025, so every
    # one of the 16 sign patterns is at least as extreme as the observed one: p = 1.
    assert c.p_value == pytest.approx(1.0)
    assert "includes 0" in verdict(c)
    # recall@100 is 1.0 everywhere: all ties, a zero interval.
    r = comps[1]
    assert (r.wins, r.ties, r.losses, r.mean_diff, r.ci_low, r.ci_high, r.p_value) == (0, 4, 0, 0.0, 0.0, 0.0, 1.0)


def test_bootstrap_is_seeded_and_a_constant_gain_is_clear():
    diff = np.full(30, 0.1)
    assert paired_bootstrap(diff) == pytest.approx((0.1, 0.1))
    # only the all-plus pattern reaches +0.1 (and all-minus -0.1): (1 + 0) / (1 + 10000) per side, doubled
    assert sign_flip_p_value(diff, 10_000) == pytest.approx(2 / 10_001)
    rng = np.random.default_rng(1)
    noisy = rng.normal(0.02, 0.1, 200)
    assert paired_bootstrap(noisy, seed=3) == paired_bootstrap(noisy, seed=3)
    low, high = paired_bootstrap(noisy, resamples=4000, seed=3, max_cells=1000)  # several memory blocks
    sd = noisy.std(ddof=1) / np.sqrt(len(noisy))
    assert low == pytest.approx(noisy.mean() - 1.96 * sd, abs=0.004)  # close to the normal interval
    assert high == pytest.approx(noisy.mean() + 1.96 * sd, abs=0.004)


def test_different_query_sets_are_refused_unless_asked(tmp_path, capsys):
    a = result(tmp_path, "a", A)
    b = result(tmp_path, "b", {**{k: v for k, v in B.items() if k != "q4"}, "q9": 0.3})
    with pytest.raises(EvalInputError, match="A has 4, B has 4, 3 in common"):
        compare_results(load_per_query(a), load_per_query(b))
    comps, info = compare_results(load_per_query(a), load_per_query(b), ["ndcg@10"], common_only=True)
    assert info["queries_common"] == 3 and comps[0].n == 3 and comps[0].mean_diff == pytest.approx(-0.2 / 3)
    # Through the CLI: one error line, exit code 2.
    assert main(["compare", a, b]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pairmine: error: the results were scored on different queries") and "Traceback" not in err


def test_cli_compare_prints_and_writes_json(tmp_path, capsys):
    a, b = result(tmp_path, "a", A), result(tmp_path, "b", B)
    out = tmp_path / "cmp.json"
    assert main(["compare", a, b + "/per_query.json", "--metric", "ndcg@10", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "queries: 4 compared" in printed and "2/1/1" in printed and "-0.0250" in printed
    saved = json.loads(out.read_text())
    assert saved["comparisons"][0]["wins"] == 2 and saved["comparisons"][0]["mean_diff"] == pytest.approx(-0.025)


def test_bad_result_files(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{not json")
    (tmp_path / "y.json").write_text(json.dumps({"queries": {}}))
    with pytest.raises(EvalInputError, match="not valid JSON"):
        load_per_query(tmp_path / "x.json")
    with pytest.raises(EvalInputError, match="not a per-query result"):
        load_per_query(tmp_path / "y.json")
    with pytest.raises(EvalInputError, match="no per-query result"):
        load_per_query(tmp_path / "nothing")
    a = load_per_query(result(tmp_path, "a", A))
    with pytest.raises(EvalInputError, match="metric 'map' is missing"):
        compare_results(a, a, ["map"])
    assert main(["compare", str(tmp_path / "x.json"), str(tmp_path / "y.json")]) == 2
    assert "Traceback" not in capsys.readouterr().err
