"""Which process spends the CPU of a training step: milliseconds of CPU per step, per process.

    python bench/cpu_shares.py                              # trl_grpo.py's `async` layout, 2 threads
    python bench/cpu_shares.py rollout.max_staleness=0         # extra KEY=VALUE overrides go to the run

Starts `python -m cloudrl.trainer --preset local` with the overrides of bench/trl_grpo.py's `async`
layout (GRPO, 64 completions of 16 tokens, the actor and the rollout engine on one thread each, then
any given here), waits for --skip steps, then reads every process's user+system time from
/proc/<pid>/stat over --window seconds and divides it by the steps logged meanwhile. The table shows
the step time, each process's CPU per step (Ray names its workers by their current call, so the
engine shows as `ray::RolloutWorker...`), and the CPU the machine had to give (cores x step time).
Linux only. One run, ~1 minute.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_grpo import LAYOUTS, clean_env, cloudrl_overrides  # noqa: E402


def cpu_seconds() -> dict[int, tuple[float, str]]:
    """pid -> (user+system CPU seconds, command line) for every process readable now."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        out[int(entry.name)] = (
            (int(fields[11]) + int(fields[12])) / tick,
            cmd or stat[stat.find("(") + 1 : stat.rfind(")")],
        )
    return out


def logged_steps(metrics: Path) -> int:
    try:
        return sum(1 for line in metrics.read_text().splitlines() if '"timing/step"' in line)
    except FileNotFoundError:
        return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip", type=int, default=8, help="steps before the window opens (default 8)")
    p.add_argument("--window", type=float, default=8.0, help="seconds of CPU time read (default 8)")
    p.add_argument("--threads", type=int, default=2, help="as trl_grpo.py --threads (default 2)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    a = p.parse_args(argv)
    defaults = argparse.Namespace(
        generations=4, prompts_per_step=16, sft_warmup_steps=0, max_new_tokens=16, lr=1e-3, steps=100_000
    )  # stopped once measured
    overrides = cloudrl_overrides(defaults) + LAYOUTS["async"][1](a.threads) + a.overrides
    run_dir = Path(tempfile.mkdtemp(prefix="cpu-shares-")) / "run"
    log = run_dir.parent / "trainer.log"
    cmd = [sys.executable, "-m", "cloudrl.trainer", "--preset", "local", *overrides, f"trainer.run_dir={run_dir}"]
    print(f"[cpu_shares] {' '.join(overrides)}; log: {log}", flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 600
        while logged_steps(metrics) < a.skip:
            if proc.poll() is not None or time.time() > deadline:
                last = (log.read_text().strip().splitlines() or ["(empty log)"])[-1]
                print(
                    f"[cpu_shares] the run ended or stalled before {a.skip} steps: {last}; log: {log}", file=sys.stderr
                )
                return 1
            time.sleep(0.2)
        before, steps_before, t0 = cpu_seconds(), logged_steps(metrics), time.time()
        time.sleep(a.window)
        after, steps, elapsed = cpu_seconds(), logged_steps(metrics) - steps_before, time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)  # the trainer's own SIGTERM path stops its local Ray
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
    if steps < 1:
        print(f"[cpu_shares] no step ended in {a.window:.0f} s; use a longer --window", file=sys.stderr)
        return 1
    used = sorted(((cpu - before.get(pid, (0.0, ""))[0], cmd) for pid, (cpu, cmd) in after.items()), reverse=True)
    step_s = elapsed / steps
    print(f"\n{steps} steps in {elapsed:.1f} s: {step_s:.4f} s/step\n\n{'CPU ms/step':>12}  process")
    for seconds, cmd in used:
        if seconds * 1000 / steps >= 0.5:
            print(f"{1000 * seconds / steps:12.1f}  {cmd[:100]}")
    total = sum(s for s, _ in used) * 1000 / steps
    print(
        f"{total:12.1f}  in all, of {1000 * step_s * (os.cpu_count() or 1):.1f} the machine's "
        f"{os.cpu_count()} cores had per step"
    )
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # the trainer's process group was stopped on the way out (main's finally)
        print("[cpu_shares] interrupted; the trainer run was stopped", file=sys.stderr)
        raise SystemExit(130) from None
