"""The theory check's tolerance: measured model states agree with Adam's 16Ψ when within 10% of it
(analyzer.diagnose.theory.AGREEMENT_TOLERANCE), on either side, and not a byte further."""
from __future__ import annotations

import math

import pytest

from analyzer.diagnose.theory import explain_model_states

MiB = 1 << 20
TOLERANCE = 0.1           # theory.AGREEMENT_TOLERANCE, as the note "within 10%" tells the user
PARAMETERS = 64 * MiB     # fp32: Ψ = 16 Mi parameters, 16Ψ = 256 MiB expected (mixed precision would expect 512 MiB)
EXPECTED = 4 * PARAMETERS
BAND = math.floor(TOLERANCE * EXPECTED)


def agreement(measured: int) -> list[bool]:
    """[fp32 Adam agrees, mixed-precision Adam agrees] for model states of `measured` bytes in all."""
    regimes = explain_model_states(PARAMETERS, PARAMETERS, measured - 2 * PARAMETERS)
    assert [r.measured_states_bytes for r in regimes] == [measured, measured]
    assert regimes[0].expected_states_bytes == EXPECTED
    return [r.agrees for r in regimes]


@pytest.mark.parametrize("measured", [EXPECTED - BAND, EXPECTED + BAND], ids=["below", "above"])
def test_model_states_within_ten_percent_of_16_psi_agree(measured):
    assert agreement(measured) == [True, False]


@pytest.mark.parametrize("measured", [EXPECTED - BAND - 1, EXPECTED + BAND + 1], ids=["below", "above"])
def test_model_states_a_byte_beyond_ten_percent_agree_with_no_regime(measured):
    assert agreement(measured) == [False, False]
