"""Sections 24 and 25 of docs/accumulation.md: each of their scripts (dropout_masks, clip_threshold, scaler_run,
packed_documents) measures what its text says, and every figure the text quotes stands there as the script
printed it, to within one unit of its last printed digit (another CPU may round the float sums behind a
3-digit figure the other way; counts are compared exactly). Each script runs in-process in a few seconds of CPU
(float64 or float32, tiny models)."""

import math
import re
from pathlib import Path

import pytest

from scripts.teaching import clip_threshold, dropout_masks, packed_documents, scaler_run

GUIDE = (Path(__file__).resolve().parent.parent / "docs" / "accumulation.md").read_text()
# Float64 sums of the same terms in another order differ by about 1e-16 relative; the scripts print such a
# figure as "< 1e-14". A layout or a count that changes the masks or the weights moves the gradient by 1e-2 or more.
ROUNDING = 1e-12


# A figure as printed: an integer (a count, compared exactly) or a decimal, possibly with an exponent.
NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def last_digit_unit(figure: str) -> float:
    """One unit of the last digit `figure` prints ("0.0412": 1e-4, "1.5e-05": 1e-6); 0 for an integer."""
    mantissa, _, exponent = figure.partition("e")
    if "." not in mantissa and not exponent:
        return 0.0
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def assert_quoted(line: str, text: str) -> None:
    """`line` as a script printed it stands in `text`, its words to the letter and each figure within one unit of
    the last digit the text prints."""
    pattern = f"({NUMBER.pattern})".join(re.escape(words) for words in NUMBER.split(line))
    measured = [float(figure) for figure in NUMBER.findall(line)]
    candidates = [match.groups() for match in re.finditer(pattern, text)]  # the same words, any figures

    def within_its_last_digit(quote: tuple) -> bool:
        pairs = zip(measured, quote, strict=True)
        return all(abs(value - float(quoted)) <= last_digit_unit(quoted) * (1 + 1e-9) for value, quoted in pairs)

    assert any(within_its_last_digit(quote) for quote in candidates), f"not quoted: {line!r}; the text has {candidates}"


def printed(script, capsys) -> str:
    assert script.main([]) == 0
    return capsys.readouterr().out


def section(number: int) -> str:
    return GUIDE.split(f"\n## {number}. ")[1].split("\n## ")[0]


def test_dropout_masks_per_rank_change_with_the_layout_row_keyed_ones_do_not_and_the_guide_quotes_them():
    dropout = dropout_masks.measure()
    layouts = [name for name in dropout["per rank"] if not name.startswith("another seed")]
    for name in layouts:
        assert dropout["per rank"][name] > 0.1, name  # the layout reseeds the dropout
        assert dropout["row-keyed"][name] < ROUNDING, name  # a pure function of the row id: exact
        assert dropout["off"][name] < ROUNDING, name
    seed = "another seed, m=8 A=1 D=1"
    assert dropout["per rank"][seed] > 0.1 and dropout["row-keyed"][seed] > 0.1 and dropout["off"][seed] < ROUNDING
    # Equal in expectation: 400 seeds' mean gradients of two layouts are far closer than one seed's (≈ 1/√400).
    expectation = {k: v for k, v in dropout["per rank, mean over seeds"].items() if k != "seeds"}
    for name, difference in expectation.items():
        assert difference < 0.2 * dropout["per rank"][name], (name, difference)
    lines = dropout_masks.report(dropout)
    for line in lines:
        assert_quoted(line, section(24))
    mean_row = next(line for line in lines if "mean over 400 seeds" in line)
    largest_mean = max(mean_row.split(" | ")[1:4], key=float)
    assert_quoted(f"the layouts agree to {largest_mean},", section(24))


def test_the_same_max_norm_clips_a_share_that_falls_with_g():
    results = clip_threshold.measure()
    by_g = results["by G"]
    shares = [by_g[g]["share clipped"] for g in clip_threshold.GLOBAL_BATCHES]
    factors = [by_g[g]["mean factor"] for g in clip_threshold.GLOBAL_BATCHES]
    assert shares == sorted(shares, reverse=True) and shares[0] > 0.9 and shares[-1] < 0.1
    assert by_g[clip_threshold.TUNED_AT]["share clipped"] == pytest.approx(0.5, abs=0.05)  # tuned at its median
    assert factors == sorted(factors)
    assert results["G=128, m=16 A=8 against one micro-batch"] < ROUNDING  # m and A at a fixed G change nothing
    lesson = section(25)
    for line in clip_threshold.report(results)[1:-1]:  # the table
        assert_quoted(line, lesson)
    assert_quoted(f"(max_norm = {results['max_norm']:.3g})", lesson)
    assert_quoted(f"scaling the update by {by_g[8]['mean factor']:.3g} on average", lesson)


def test_the_scaler_skips_each_spike_halves_then_regrows_after_growth_interval():
    results = scaler_run.run()
    assert results["skipped at a spike"] == list(scaler_run.SPIKES)  # a spike always costs its update
    assert results["skipped at the ceiling"], "the scale never reached fp16's ceiling"
    path = dict(results["scale path"])
    steps = sorted(path)
    for before, after in zip(steps, steps[1:], strict=False):
        ratio = path[after] / path[before]
        if after - 1 in results["skipped"]:
            assert ratio == 0.5, (after, ratio)  # halved after each skip
        else:
            assert ratio == 2 and after - before >= scaler_run.GROWTH_INTERVAL, (after, ratio)  # a clean run
    lesson = section(25)
    for line in scaler_run.report(results)[1:-1]:  # skips, share, highest scale
        assert_quoted(f"    {line}\n", lesson)
    assert f"{len(results['skipped'])} skipped\nupdates of {scaler_run.STEPS}" in lesson
    at_150 = math.log2(path[150])
    assert f"from 2^16 to 2^{at_150:.0f} by update 150" in lesson
    ceiling = results["skipped at the ceiling"]
    assert f"(updates {', '.join(map(str, ceiling[:-1]))} and {ceiling[-1]})" in lesson
    reached = min(step for step, scale in path.items() if scale == results["ceiling"])
    assert f"2^{math.log2(results['ceiling']):.0f} was reached at update {reached}" in lesson


def test_per_document_means_are_exact_from_the_steps_counts_and_each_miscount_is_not(capsys):
    results = packed_documents.measure()
    for m, a in packed_documents.LAYOUTS:
        assert results[f"correct, m={m} A={a}"] < ROUNDING
    for wrong in ("rows as documents", "documents counted per micro-batch", "a split document counted twice"):
        assert results[wrong] > 0.1, wrong
    assert results["row boundaries inside a document"] > 0  # a document does run across rows
    text = printed(packed_documents, capsys)
    lesson = section(25)
    values = dict(line.split(": ", 1) for line in text.strip().splitlines())
    assert f"packs {values['documents in the step']} documents" in lesson
    assert f"(all {values['row boundaries inside a document']} row\nboundaries fall inside a document)" in lesson
    rows = {
        "rows as documents": "rows as documents (each row's token mean, averaged over rows)",
        "documents counted per micro-batch": "documents counted per micro-batch, × 1/A",
        "a split document counted twice": "a split document counted as two (its pieces counted row by row)",
        "token mean (another objective)": "the token mean (another objective, not a bug)",
    }
    for name, cell in rows.items():
        assert_quoted(f"| {cell} | {values[name]} |", lesson)
    assert re.search(r"\| weights from the step's counts, [^|]* \| < 1e-14 \|", lesson)


def test_a_quote_is_held_to_its_last_digit_and_a_count_exactly():
    assert_quoted("| 8 | 0.412 |", "a | 8 | 0.413 | b")  # one unit of the quoted last digit: another CPU's rounding
    for wrong in ("| 8 | 0.415 |", "| 9 | 0.412 |", "| 8 | 1.5e-05 |"):
        with pytest.raises(AssertionError):
            assert_quoted("| 8 | 0.412 |", f"a {wrong} b")
    assert_quoted("agree to 1.51e-05,", "agree to 1.5e-05, as")  # 1.5e-05 prints to 1e-06
