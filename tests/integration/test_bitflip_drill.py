"""The bit-flip drill: scripts/drills/bitflip.py against real training processes.

The fast variant flips two bytes (each in its own copy of a finished run); the full drill is
``pytest -m slow`` or the script itself (figures in docs/reliability.md).
"""

from __future__ import annotations

import pytest
from support import load_script

drill = load_script("drills/bitflip")


def test_a_flipped_byte_is_detected_and_the_resume_from_the_previous_checkpoint_is_bit_identical(
    tmp_path, prepared
):
    report = drill.run_drill(tmp_path, drill.FlipSpec(trials=2, seed=3, max_steps=12, save_every=3), prepared)
    drill.print_report(report)
    assert report["trials"] == 2
    assert report["found_before_load"] == report["detected"] == 2
    assert report["resumed_previous"] == 2 and report["identical"] == 2
    for r in report["trial_results"]:
        assert r["resumed_from"].endswith("step_00000009") and r["warning"].count("\n") == 0


@pytest.mark.slow
def test_full_bitflip_drill(tmp_path, prepared):
    report = drill.run_drill(tmp_path, drill.FlipSpec(trials=20), prepared)
    drill.print_report(report)
    assert report["detected"] == report["resumed_previous"] == report["identical"] == 20
