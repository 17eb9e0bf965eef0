"""00_target's coherence check of the target's reply: it passes the real SmolLM2 reply (recorded on the GPU) and
fails each way a broken target answers."""
import pytest

from eagle3kit.target import reply_problems

REAL = ("Spatitual decoding is a technique used to analyze and manipulate data by exploiting the limitations of "
        "traditional data analysis methods, such as the inability to manipulate or manipulate data.")  # gpu-00-target


def test_the_recorded_reply_is_coherent():
    assert reply_problems(REAL, expect_any=("decod",)) == []


@pytest.mark.parametrize("reply, why", [
    ("", "words"),
    ("Speculative decoding.", "words"),  # too short to tell
    ("âĢ¦ ĠĊĊ ðŁĺ ĠâĢľ âĢĿĊ 1234 5678 %%% ### âĢ¦ decod 0x1f 0x2e 0x3a ;;; :: ]]]", "letters"),  # byte-level soup
    ("decoding decoding is is the the decoding is the the decoding is the the decoding is the the decoding is the",
     "repeats"),
    ("The weather in the mountains was cold, and we walked for hours along the river before dinner.", "none of"),
])
def test_broken_replies_are_named(reply, why):
    problems = reply_problems(reply, expect_any=("decod",))
    assert problems and any(why in p for p in problems), problems
