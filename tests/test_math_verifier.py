"""Rule-based math reward: extraction, normalization, equivalence, and the timeout worker."""

from __future__ import annotations

import threading
import time

import pytest

from arealcli.runtime.rewards import math_verifier as mv
from arealcli.runtime.rewards.math_verifier import (
    MathVerifier,
    _slow_check_for_tests,
    answers_equivalent,
    extract_answer,
    math_reward,
    normalize_answer,
)

# ---------------------------------------------------------------------------------------------
# extract_answer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # the LAST boxed wins; nested braces are matched
        (r"first \boxed{1}, then \boxed{\frac{\sqrt{3}}{2}}.", r"\frac{\sqrt{3}}{2}"),
        (r"$\boxed{\left\{1, 2\right\}}$", r"\left\{1, 2\right\}"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\fbox{7}", "7"),
        (r"\boxed 5", "5"),
        (r"\boxed{x} and a broken \boxed{y", "x"),
        # fallback patterns
        ("So the answer is $42$.", "42"),
        ("The final answer is 3/4. Done.", "3/4"),
        ("Answer: -7", "-7"),
        ("work...\n#### 1,234", "1,234"),
        ("the answer is 12 and not 13\nanswer: 14", "14"),
        # last number
        ("I got 3, then 5.", "5"),
        ("first 3 then -4.5", "-4.5"),
        ("x-5", "5"),  # binary minus is no sign
        ("it is .5 or 3/4", "3/4"),
        ("total 1,234,567 items", "1234567"),
        ("1, 2, 3", "3"),
        # nothing
        ("no digits here", None),
        ("", None),
        (r"\boxed{unclosed", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_non_string():
    assert extract_answer(None) is None  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# normalize_answer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  $\\dfrac{1}{2}$ ", r"\frac{1}{2}"),
        (r"\tfrac12", r"\frac{1}{2}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"3\!\cdot\!4", r"3\cdot4"),
        ("7.", "7"),
        (r"5\text{ cm}^2", "5"),
        (r"12 \mbox{ inches}", "12"),
        (r"\text{Monday}", "Monday"),  # a whole-answer \text is unwrapped, not dropped
        (r"30^\circ", "30"),
        (r"30^{\circ}", "30"),
        (r"50\%", "50"),
        ("1,000", "1000"),
        (r"\$1{,}000", "1000"),
        ("(1,000, 2)", "(1,000,2)"),  # commas in a tuple are not thousands separators
        ("x = 3", "3"),
        (r"\theta = 45^\circ", "45"),
        ("y = 2x + 1", "2x+1"),
        ("18 dollars", "18"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"\pi r^2", r"\pi r^2"),  # the space that ends a command survives
        ("(B)", "B"),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


# ---------------------------------------------------------------------------------------------
# answers_equivalent
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pred", "ref"),
    [
        (r"\frac{1}{2}", "0.5"),
        ("1/2", r"\dfrac12"),
        (r"-\frac{1}{2}", "-0.5"),
        ("x = 3", "3"),
        (r"2\sqrt{2}", r"\sqrt{8}"),
        ("1,000", "1000"),
        ("3.0", "3"),
        ("0.50001", "0.5"),  # 2e-5 relative < 1e-4
        (r"\pi", "3.14159"),
        ("(x+1)^2", "x^2+2x+1"),
        (r"\{1,2\}", r"\{2,1\}"),
        (r"\text{Monday}", "Monday"),
        # percent: the sign is dropped, and a % value also matches value / 100
        (r"50\%", "50"),
        ("50%", "0.5"),
        (r"0.5", r"50\%"),
    ],
)
def test_equivalent(pred, ref):
    assert answers_equivalent(pred, ref)


@pytest.mark.parametrize(
    ("pred", "ref"),
    [
        ("2", "3"),
        ("0.5001", "0.5"),  # 2e-4 relative > 1e-4
        ("-3", "3"),
        ("0.5", "50"),  # no % on either side: not a percentage
        (r"\pi", "3.14"),
        ("[0,1)", "[0,1]"),
        ("x^2", "y^2"),
        ("0", "1e-9"),
        ("3}+1", "3"),  # a stray brace must not close the parser's \boxed{} early
    ],
)
def test_not_equivalent(pred, ref):
    assert not answers_equivalent(pred, ref)


def test_rel_tol_is_respected():
    assert answers_equivalent("0.5001", "0.5", rel_tol=1e-3)
    assert not answers_equivalent("100.5", "100", rel_tol=1e-3)


@pytest.mark.parametrize(
    ("pred", "ref"),
    [
        ("garbage}}{{\\", "1"),
        (r"\frac{", r"\sqrt{"),
        ("", ""),
        ("", "1"),
        (r"\frac{1}{0}", "1"),
        (r"2^{2^{2^{100}}}", "1"),  # astronomically large: rejected without hanging
        ("\x00\x01\x02", "\\\\\\"),
        (None, "1"),
        (["1"], "1"),
    ],
)
def test_garbage_is_false_not_an_error(pred, ref):
    assert answers_equivalent(pred, ref) is False


def test_adversarial_text_is_linear_time():
    start = time.monotonic()
    assert extract_answer("\\boxed{" * 50_000 + "1") == "1"  # unclosed boxes, then the last number
    normalize_answer("1 " + "ab" * 5_000 + "!")  # no catastrophic backtracking in the unit regex
    extract_answer("-1," * 20_000)
    assert time.monotonic() - start < 2.0


def test_numeric_references_from_a_dataset():
    assert answers_equivalent("42", 42)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# MathVerifier (worker subprocess, per-item timeout)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(timeout_s=10.0) as v:
        yield v


def test_score_and_batch(verifier):
    assert verifier.score(r"so $\boxed{\dfrac{1}{2}}$", ["0.5"]) == 1.0
    assert verifier.score(r"\boxed{3}", ["2"]) == 0.0
    assert verifier.score("no answer at all", ["2"]) == 0.0
    responses = [
        r"... \boxed{2\sqrt{2}}",
        "The answer is 1,000.",
        "so x = 3",
        r"\boxed{7}",
        "I think 12 dollars",
    ]
    answers = [[r"\sqrt{8}"], ["1000"], ["3"], ["8"], ["12"]]
    assert verifier.score_batch(responses, answers) == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_any_reference_matches(verifier):
    assert verifier.score(r"\boxed{0.25}", ["1/3", r"\frac{1}{4}"]) == 1.0
    assert verifier.score(r"\boxed{0.2}", ["1/3", r"\frac{1}{4}"]) == 0.0
    assert verifier.score(r"\boxed{5}", []) == 0.0


def test_reference_with_full_solution(verifier):
    # GSM8K-style references carry the solution; their final answer is extracted.
    assert verifier.score("answer: 72", ["48 + 24 = 72\n#### 72"]) == 1.0


def test_garbage_responses_score_zero(verifier):
    responses = ["\\boxed{\\frac{", "}}}{{{", "", "\\boxed{}", "\x00" * 10]
    assert verifier.score_batch(responses, [["1"]] * len(responses)) == [0.0] * len(responses)


def test_batch_length_mismatch_is_an_error(verifier):
    with pytest.raises(ValueError, match="one list of reference answers per response"):
        verifier.score_batch(["a", "b"], [["1"]])


def test_works_from_a_non_main_thread(verifier):
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(verifier.score(r"\boxed{(x+1)^2}", ["x^2+2x+1"])))
    t.start()
    t.join(30)
    assert out == [1.0]


def test_timeout_kills_the_item_and_the_worker_recovers():
    """Fault injection: ``_slow_check_for_tests`` sleeps on "SLEEP <s>" like a pathological item."""
    with MathVerifier(timeout_s=0.5, _check=_slow_check_for_tests) as v:
        v._ensure_worker()
        first_pid = v._proc.pid
        start = time.monotonic()
        scores = v.score_batch(
            ["SLEEP 60", r"\boxed{2}", "SLEEP 60", r"\boxed{\frac{1}{3}}"],
            [["1"], ["2"], ["1"], ["1/3"]],
        )
        elapsed = time.monotonic() - start
        assert scores == [0.0, 1.0, 0.0, 1.0]
        assert elapsed < 15.0  # 2 x 0.5 s timeouts + 2 worker restarts, never the 60 s sleeps
        assert v.num_restarts == 2
        assert v._proc.pid != first_pid
        # an item that is slow but within the limit is not cut off
        assert v.score("SLEEP 0.1", ["1"]) == 1.0
        assert v.num_restarts == 2


def test_crashed_worker_scores_zero_and_restarts():
    with MathVerifier(timeout_s=5.0, _check=_slow_check_for_tests) as v:
        assert v.score_batch(["CRASH", r"\boxed{4}"], [["4"], ["4"]]) == [0.0, 1.0]
        assert v.num_restarts == 1


def test_close_stops_the_worker_and_a_later_call_restarts_it():
    v = MathVerifier(timeout_s=5.0)
    assert v.score(r"\boxed{1}", ["1"]) == 1.0
    proc = v._proc
    v.close()
    assert v._proc is None and proc.poll() is not None
    assert v.score(r"\boxed{1}", ["1"]) == 1.0  # lazily restarted
    v.close()


def test_math_reward_shared_verifier():
    assert math_reward([r"\boxed{6}", "The answer is 7."], [["6"], ["8"]]) == [1.0, 0.0]
    assert mv._shared is not None
    mv._shared.close()


def test_module_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys; import arealcli.runtime.rewards.math_verifier as m; "
        "m.answers_equivalent('1/2', '0.5'); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
