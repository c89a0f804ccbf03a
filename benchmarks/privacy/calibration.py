"""Seconds per noise calibration (`jdp.accounting.calibrate`) for the events jdp's packages calibrate, with the
search over windows of RDP orders (the default) beside the same search over every order, in one process.

Each calibration starts with an empty ε memo; the two variants alternate over `--rounds` rounds and the table
keeps each one's best round. Both must return the same parameter (checked to 1e-6 relative); "accountings"
counts dp_accounting runs (every order / a window).

    PYTHONPATH=. python -m benchmarks.privacy.calibration [--rounds 3]

writes benchmarks/privacy/results/accounting_calibration.json.
"""
from __future__ import annotations

import argparse
import time

from dp_accounting import dp_event as dpe

from benchmarks.common import write_results
from jdp import accounting as acc
from jdp.clipping.dp_sgd import dp_sgd_event

DELTA = 1e-5


def _cases() -> list[tuple[str, float, object]]:
    """(name, ε, make_event): the shapes of the packages' calibrations."""
    histogram = acc.gaussian_event(4.0)
    return [
        ("seqrec quick run: histogram + 16 DP-SGD steps, q 0.128", 8.0,
         lambda s: dpe.ComposedDpEvent([histogram, dp_sgd_event(s, 0.128, 16)])),
        ("DPFormer 20 epochs: 606 steps, q 1024/23,715", 8.0, lambda s: dp_sgd_event(s, 1024 / 23715, 606)),
        ("DPFormer 100 epochs: 3,029 steps", 8.0, lambda s: dp_sgd_event(s, 1024 / 23715, 3029)),
        ("DP-SGD 10,000 steps, q 0.01", 1.0, lambda s: dp_sgd_event(s, 0.01, 10000)),
        ("DP-SGD 3 steps, q 0.25", 2.0, lambda s: dp_sgd_event(s, 0.25, 3)),
        ("DP-SGD 40 steps, q 0.5", 20.0, lambda s: dp_sgd_event(s, 0.5, 40)),
        ("meta-NSGD, Poisson: 700 steps of 10 of 700 tasks", 1.0, lambda s: dp_sgd_event(s, 10 / 700, 700)),
        ("altmin SSP: counts + 10 Gaussian steps", 1.0,
         lambda s: dpe.ComposedDpEvent([acc.gaussian_event(3 * s), dpe.SelfComposedDpEvent(
             dpe.ComposedDpEvent([acc.gaussian_event(s), acc.gaussian_event(s)]), 10)])),
    ]


def _calibrate(make_event, epsilon: float, window: int) -> tuple[float, float, int, int]:
    """(parameter, seconds, accountings over every order, over a window) of one calibration from an empty memo."""
    n_all = len(acc.DEFAULT_RDP_ORDERS)
    calls: list[int] = []
    account, saved = acc.events._account, acc.calibration._ORDER_WINDOW

    def counted(event, *args):
        calls.append(len(args[2]))
        return account(event, *args)

    acc.events._account, acc.calibration._ORDER_WINDOW = counted, window
    acc.events._ACCOUNTED.clear()
    try:
        t0 = time.perf_counter()
        sigma = acc.calibrate(make_event, epsilon, DELTA, bracket=(0.05, 500.0))
        seconds = time.perf_counter() - t0
    finally:
        acc.events._account, acc.calibration._ORDER_WINDOW = account, saved
    every = sum(n == n_all for n in calls)
    return sigma, seconds, every, len(calls) - every


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    variants = {"windows": acc.calibration._ORDER_WINDOW, "every order": len(acc.DEFAULT_RDP_ORDERS)}
    rows = []
    for name, epsilon, make_event in _cases():
        best: dict[str, tuple] = {}
        for _ in range(args.rounds):
            for variant, window in variants.items():
                run = _calibrate(make_event, epsilon, window)
                if variant not in best or run[1] < best[variant][1]:
                    best[variant] = run
        (s_w, t_w, every_w, win_w), (s_a, t_a, every_a, _) = best["windows"], best["every order"]
        if abs(s_w - s_a) > 1e-6 * s_a:
            raise AssertionError(f"{name}: windows gave {s_w}, every order {s_a}")
        rows.append({"event": name, "epsilon": epsilon, "delta": DELTA, "noise_multiplier": s_w,
                     "epsilon_spent": acc.compute_epsilon(make_event(s_w), DELTA),
                     "seconds_windows": t_w, "seconds_every_order": t_a, "speedup": t_a / t_w,
                     "accountings_windows": f"{every_w} every order + {win_w} windows",
                     "accountings_every_order": every_a})
        print(f"{name}: σ {s_w:.6f}, {t_w:.2f} s ({every_w} + {win_w} windows) vs {t_a:.2f} s ({every_a}): "
              f"{t_a / t_w:.1f}×", flush=True)
    total_w, total_a = sum(r["seconds_windows"] for r in rows), sum(r["seconds_every_order"] for r in rows)
    print(f"all: {total_w:.2f} s vs {total_a:.2f} s ({total_a / total_w:.1f}×)")
    write_results("accounting_calibration", rows, rounds=args.rounds, order_window=acc.calibration._ORDER_WINDOW,
                  orders=len(acc.DEFAULT_RDP_ORDERS))


if __name__ == "__main__":
    main()
