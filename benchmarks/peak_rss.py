"""Peak memory of a command and all its child processes, sampled.

GNU ``time -v`` reports the largest single process, not the sum over worker processes; this
samples the whole process tree every ``--every`` seconds and prints the peak of the summed
RSS and of the summed PSS (proportional set size: pages shared copy-on-write between forked
workers counted once in total, so PSS is what the machine really spends).

    python benchmarks/peak_rss.py [--every 0.5] -- eldr reproduce --quick --jobs 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psutil


def tree_memory(root: psutil.Process) -> tuple[int, int, int]:
    """(Σ RSS, Σ PSS, number of processes) of ``root`` and its descendants, in bytes."""
    rss = pss = n = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            info = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
        n += 1
    return rss, pss, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=float, default=0.5, help="sampling period (s)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command given")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    root = psutil.Process(proc.pid)
    peak_rss = peak_pss = peak_n = 0
    while proc.poll() is None:
        rss, pss, n = tree_memory(root)
        peak_rss, peak_pss, peak_n = max(peak_rss, rss), max(peak_pss, pss), max(peak_n, n)
        time.sleep(args.every)
    wall = time.perf_counter() - t0
    print(f"peak RSS (sum over processes) {peak_rss / 2**30:.2f} GiB, peak PSS "
          f"{peak_pss / 2**30:.2f} GiB, up to {peak_n} processes, wall {wall:.0f} s, "
          f"exit {proc.returncode}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
