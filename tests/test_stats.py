"""The noise helpers: intervals of a mean and of a difference (Student's t, Welch), pooled seed noise, and the runner
that trains several seeds side by side."""

import math
import sys
from statistics import mean, stdev

import pytest

from my_utils.core.stats import Noise, difference, mean_interval, pooled_noise, t95
from my_utils.run.seeds import run_seeds


def test_the_mean_interval_is_students_t():
    values = [0.81, 0.86, 0.79]
    interval = mean_interval(values)
    half = 4.303 * stdev(values) / math.sqrt(3)  # t with 2 degrees of freedom
    assert (interval.mean, interval.low, interval.high) == pytest.approx((mean(values), mean(values) - half,
                                                                          mean(values) + half))
    assert str(interval) == f"{mean(values):.3f} [{mean(values) - half:.3f}, {mean(values) + half:.3f}]"
    assert t95(1) == 12.706 and t95(2.7) == 4.303 and t95(1000) == 2.0  # fractional degrees of freedom round down
    with pytest.raises(ValueError, match="2 or more"):
        mean_interval([1.0])


def test_a_difference_is_separated_only_when_its_interval_leaves_out_zero():
    apart = difference([0.81, 0.86, 0.79], [0.95, 0.99, 0.91])
    assert apart.mean == pytest.approx(-0.13) and apart.excludes(0) and not apart.inside(-0.05, 0.05)
    together = difference([0.81, 0.86, 0.79], [0.80, 0.88, 0.82])
    assert not together.excludes(0)
    noisier = difference([0.81, 0.86, 0.79], [0.5, 1.4, 0.7])  # Welch: the noisier setting widens the interval
    assert noisier.high - noisier.low > together.high - together.low
    assert difference([1.0, 1.0], [2.0, 2.0]).excludes(0)  # no spread at all: the difference is exact


def test_pooled_noise_judges_single_runs():
    noise = pooled_noise([[1.9, 2.0, 2.1], [1.5, 1.6, 1.7]])
    assert noise == Noise(sd=pytest.approx(0.1), df=4)
    assert noise.difference(1.6, 2.0).excludes(0) and not noise.difference(1.9, 2.0).excludes(0)
    # a mean of 3 seeds against one run: a narrower interval than two single runs
    one, three = noise.difference(1.8, 2.0), noise.difference(1.8, 2.0, n_a=3, n_b=3)
    assert three.high - three.low < one.high - one.low
    with pytest.raises(ValueError):
        pooled_noise([[1.0]])


@pytest.mark.slow
def test_seeds_run_side_by_side_each_into_its_folder(tmp_path, capsys):
    script = ("import sys; from my_utils.run.results import Run; seed = int(sys.argv[2]); "
              "print('training seed', seed); Run.create(sys.argv[1], config={'seed': seed}).finish({'x': 10 * seed})")

    def command(factor):
        return lambda seed, out: [sys.executable, "-c", script.replace("10 * seed", f"{factor} * seed"), str(out),
                                  str(seed)]

    runs = run_seeds(command(10), tmp_path / "one", jobs=2)
    assert [r["summary"]["x"] for r in runs] == [0, 10, 20]
    assert (tmp_path / "one" / "seed_2.log").read_text().splitlines()[-1] == "training seed 2"
    by_setting = run_seeds({"a": command(1), "b": command(2)}, tmp_path / "two", seeds=(3, 4))
    assert {k: [r["summary"]["x"] for r in v] for k, v in by_setting.items()} == {"a": [3, 4], "b": [6, 8]}
    shown = capsys.readouterr().out.splitlines()
    assert len(shown) == 2 and "3 runs (seeds 0, 1, 2) done in" in shown[0] and "4 runs (seeds 3, 4)" in shown[1]
    failing = lambda seed, out: [sys.executable, "-c", "raise SystemExit('no data')"]  # noqa: E731
    with pytest.raises(RuntimeError, match="no data"):
        run_seeds(failing, tmp_path / "three", seeds=(0,))
