"""How the CPU workers one launcher starts on a host share its cores (`pdserve up`, deploy/launch.py).

Each worker gets every core by default (`--threads-per-worker` overrides): co-located roles are rarely
busy at once (a prefill burst, then decode steps), and a role that holds only its even share leaves the
rest idle whenever the other waits. Measured on 2 cores (docs/benchmarks.md, bundled model, bf16 +
w4a16): 2 threads per worker against the even split of 1, 30.1 against 27.0 output tok/s at concurrency 1
and 177 against 156 at concurrency 16.

When the workers' threads outnumber the cores, two OpenMP teams running at once spin at barriers for
partners the other team preempted. `--cpu-sharing` picks the remedy:

- `turns` (default): every forward holds an exclusive lock on one file (`--cpu-forward-lock`,
  runtime/forward_turns.py), so one team computes at a time; a long forward lets a waiting worker's forward
  run between its layers. Prefill workers spin only briefly between
  parallel regions (GOMP_SPINCOUNT=10000, ~0.1 ms) so that an idle prefill team soon stops taking CPU
  from the decode steps; decode workers keep libgomp's default (spin ~300,000 rounds, then sleep), which
  their back-to-back steps need (a batch-1 step makes ~210 matmul, gather and attention calls, and
  sleeping threads woken for their regions cost ~25%: offline batch-1 steps 17.6-19.0 ms against
  23.6-24.1 passive, Xeon). A prefill forward then runs as fast as in a process of its own.
- `passive`: prefill workers' OpenMP threads sleep at once when idle (OMP_WAIT_POLICY=PASSIVE) and
  forwards overlap. Each of the prefill's parallel regions (~330 in a 128-token forward) pays a
  wake-up: 32-77 ms more per prefill than offline on the EPYC.

A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is left alone (turns still apply). With an even split
(`--threads-per-worker` times the workers at most the cores) nothing is shared and nothing is set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdserve import env

CPU_SHARING = ("turns", "passive")
PREFILL_SPIN_COUNT = 10_000  # libgomp spin rounds before a prefill thread sleeps (turns)


@dataclass(frozen=True)
class CpuShare:
    threads: int  # torch threads of each worker
    shared: bool  # the workers' threads outnumber the cores
    sharing: str  # one of CPU_SHARING
    lock_path: str  # the turns' lock file (used when shared and sharing == "turns")

    def env(self, role: str) -> dict[str, str]:
        """Extra environment of one worker of `role` ("prefill" | "decode")."""
        if not self.shared or role != "prefill" or env.omp_wait_policy_set():
            return {}
        if self.sharing == "passive":
            return {"OMP_WAIT_POLICY": "PASSIVE"}
        return {} if env.gomp_spincount_set() else {"GOMP_SPINCOUNT": str(PREFILL_SPIN_COUNT)}

    def flags(self, threads: bool = True) -> list[str]:
        """Extra flags of every worker (`threads`: with its --num-threads)."""
        turns = self.shared and self.sharing == "turns" and bool(self.lock_path)
        return (["--num-threads", str(self.threads)] if threads else []) + (
            ["--cpu-forward-lock", self.lock_path] if turns else []
        )


def cpu_share(requested: int | None, n_workers: int, sharing: str, lock_path: str) -> CpuShare:
    """The plan for `n_workers` CPU workers on this host with `requested` threads each (None: every core)."""
    if sharing not in CPU_SHARING:
        raise ValueError(f"--cpu-sharing must be one of {', '.join(CPU_SHARING)}, not {sharing!r}")
    cores = os.cpu_count() or 1
    threads = requested or cores
    return CpuShare(threads, n_workers * threads > cores, sharing, lock_path)
