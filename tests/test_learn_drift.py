import numpy as np
import pytest

from _learn_data import mix, requests
from eldr.fit.signature import SignatureEncoder
from eldr.learn.drift import DriftDetector
from eldr.traces.trace import Trace, TraceMeta

WINDOW = 100


def _calibrated(seed: int, shares=(1, 1, 1, 1)):
    rng = np.random.default_rng(seed)
    pre, dec, plen, olen = requests(rng, mix(rng, 400, shares))
    ref = Trace(meta=TraceMeta(model="s", num_layers=pre.shape[1], num_experts=pre.shape[2],
                               top_k=2), prefill_counts=pre, decode_counts=dec,
                prompt_lens=plen, output_lens=olen)
    enc = SignatureEncoder(layers=range(pre.shape[1]), random_state=seed).fit(ref)
    det = DriftDetector(window=WINDOW, alpha=0.01, patience=2, random_state=seed)
    return rng, enc, det.calibrate(enc.transform(ref), dec)


def test_quiet_on_resampling_noise():
    """Unshifted traffic, fresh draws: 8 seeded runs of 5 windows each."""
    exceeded, windows = 0, 0
    for seed in range(8):
        rng, enc, det = _calibrated(seed)
        pre, dec, _, _ = requests(rng, mix(rng, 5 * WINDOW, (1, 1, 1, 1)))
        reports = det.update(enc.transform(pre), dec)
        shift = [r for r in reports if r.signal == "shift"]
        assert len(shift) == 5
        exceeded += sum(r.exceeded for r in shift)
        windows += len(shift)
        assert not det.drifted, (seed, [(r.signal, r.score) for r in reports])
    assert exceeded / windows <= 0.05


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fires_on_a_domain_mix_shift(seed):
    rng, enc, det = _calibrated(seed)
    pre, dec, _, _ = requests(rng, mix(rng, 2 * WINDOW, (0.7, 0.1, 0.1, 0.1)))
    reports = det.update(enc.transform(pre), dec)
    assert [r.exceeded for r in reports if r.signal == "shift"] == [True, True]
    assert det.drifted


def test_rho_fires_when_decode_stops_following_the_signature():
    """Same prompts, but decode routing no longer matches them: only rho can see it."""
    rng, enc, det = _calibrated(4)
    pre, dec, _, _ = requests(rng, mix(rng, 2 * WINDOW, (1, 1, 1, 1)))
    shuffled = dec[rng.permutation(dec.shape[0])]
    reports = det.update(enc.transform(pre), shuffled)
    assert [r.exceeded for r in reports if r.signal == "shift"] == [False, False]
    assert [r.exceeded for r in reports if r.signal == "rho"] == [True, True]
    assert det.drifted


def test_no_decode_counts_no_rho():
    rng, enc, det = _calibrated(5)
    pre, _, _, _ = requests(rng, mix(rng, WINDOW, (1, 1, 1, 1)), with_decode=False)
    assert {r.signal for r in det.update(enc.transform(pre))} == {"shift"}


def test_distinct_experts_rise_is_reported_and_fires_only_when_asked():
    for fires in (False, True):
        det = DriftDetector(window=10, patience=1, rise=0.2, distinct_fires=fires)
        assert det.push_steps("d0", np.full(10, 20.0)) is None  # the reference window
        rep = det.push_steps("d0", np.full(10, 25.0))
        assert rep.signal == "distinct" and rep.statistic == pytest.approx(1.25)
        assert rep.exceeded and det.drifted is fires


def test_calibration_needs_enough_rows():
    with pytest.raises(ValueError, match="need at least 110"):
        DriftDetector(window=100).calibrate(np.eye(50))
    with pytest.raises(ValueError, match="not calibrated"):
        DriftDetector(window=10).check(None)
