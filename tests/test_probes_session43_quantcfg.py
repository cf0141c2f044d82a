"""Session 43 probes of `infer quantize` / `infer convert` options and inputs (calibration files, GPTQ settings)."""

from __future__ import annotations

import pytest

from infer.errors import ConfigError
from infer.quant import calibration as calib_mod


def test_txt_blank_lines_holding_spaces_separate_paragraphs(tmp_path):
    """A line with only spaces or tabs is a blank line (as editors show it): it separates paragraphs, so the lines of
    one paragraph stay one sample instead of each line becoming a sample (an EOS between them)."""
    f = tmp_path / "c.txt"
    f.write_text("first para\nstill first\n  \nsecond para\nstill second\n\t\nthird\n")
    assert calib_mod.read_texts(f) == ["first para\nstill first", "second para\nstill second", "third"]
    f.write_text("a\nb\n\nc\nd\n \ne\n")  # mixed: an empty and a spaces-only blank line
    assert calib_mod.read_texts(f) == ["a\nb", "c\nd", "e"]
