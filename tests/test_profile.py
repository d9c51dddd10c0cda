"""Latency profiles: the profile.json contract, lookups between and past measured points, noise
filtering, clear errors for bad files, and a real (quick) measurement on a tiny target."""

import json

import pytest

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.profile import LatencyProfile, measure_latency_profile, suffix_minimum


def profile():
    return LatencyProfile("torch-cpu", "cpu:test", [1, 8, 64], [0.05, 0.06, 0.2], [1, 4], [0.01, 0.02])


def test_round_trip_in_the_design_format(tmp_path):
    path = tmp_path / "profile.json"
    profile().save(path)
    data = json.loads(path.read_text())
    assert data == {"backend": "torch-cpu", "device": "cpu:test",
                    "target": {"batch_tokens": [1, 8, 64], "step_seconds": [0.05, 0.06, 0.2]},
                    "drafter": {"num_requests": [1, 4], "step_seconds": [0.01, 0.02],
                                "catch_up_seconds_per_position": 0.0}}
    assert LatencyProfile.load(path) == profile()
    del data["drafter"]["catch_up_seconds_per_position"]  # a profile written before it was measured
    path.write_text(json.dumps(data))
    assert LatencyProfile.load(path) == profile()
    with_catch_up = LatencyProfile(**{**vars(profile()), "catch_up_seconds_per_position": 2e-5})
    with_catch_up.save(path)
    assert LatencyProfile.load(path) == with_catch_up and with_catch_up.catch_up_seconds(100) == pytest.approx(2e-3)
    assert with_catch_up.catch_up_seconds(-3) == 0.0


def test_lookups_interpolate_and_extrapolate():
    p = profile()
    assert p.target_seconds(1) == pytest.approx(0.05)
    assert p.target_seconds(36) == pytest.approx(0.06 + 0.14 * 28 / 56)
    assert p.target_seconds(128) == pytest.approx(0.2 + 0.14 * 64 / 56)  # along the last segment
    assert p.drafter_seconds(0) == 0.0 and p.drafter_seconds(2) == pytest.approx(0.01 + 0.01 / 3)


def test_suffix_minimum_removes_noise_spikes():
    assert suffix_minimum([0.05, 0.33, 0.06, 1.0, 0.2]) == [0.05, 0.06, 0.06, 0.2, 0.2]


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "not valid JSON"),
    ('{"backend": "x", "device": "y"}', "missing keys"),
    ('{"backend": "x", "device": "y", "target": {"batch_tokens": [1], "step_seconds": [0.1]}, "extra": 1}',
     "unknown keys"),
    ('{"backend": "x", "device": "y", "target": {"batch_tokens": [4, 2], "step_seconds": [0.1, 0.2]}}',
     "increasing"),
    ('{"backend": "x", "device": "y", "target": {"batch_tokens": [1, 2], "step_seconds": [0.1]}}', "2 sizes"),
    ('{"backend": "x", "device": "y", "target": {"batch_tokens": [1], "step_seconds": [-1]}}', "positive"),
])
def test_bad_profiles_are_refused_with_a_reason(tmp_path, content, fragment):
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(DsparkError, match=fragment):
        LatencyProfile.load(path)
    with pytest.raises(DsparkError, match="does not exist"):
        LatencyProfile.load(tmp_path / "missing.json")


def test_quick_measurement_on_a_tiny_target(tiny_llama):
    from dspark_trt.models.loading import load_target
    from dspark_trt.runtime.dspark_proposer import DSparkProposer
    from tiny_drafters import make_drafter

    target = load_target(tiny_llama)
    proposer = DSparkProposer(make_drafter(target))
    measured = measure_latency_profile(target, proposer, max_batch_tokens=32, max_requests=4, quick=True)
    assert measured.target_batch_tokens == [1, 2, 4, 8, 16, 32]
    assert measured.drafter_num_requests == [1, 2, 4]
    assert all(t > 0 for t in measured.target_step_seconds + measured.drafter_step_seconds)
    assert measured.target_step_seconds == sorted(measured.target_step_seconds)  # after the suffix minimum
    assert not proposer.pool.slot_of and not proposer.queued  # the measurement's requests were released
