"""The systems comparison as named tables: the runs each table needs, how it is built, and the jobs run once each.

:class:`Suite` runs every job at most once per session, in plan order, and after each job rebuilds every selected
table that has a finished run, so that ``report.md`` always holds every table so far: a run still to come is
``pending``, one the benchmark never got to is ``not run``, the job running when it was stopped is ``interrupted``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from bench import tables
from bench.baselines.runner import RunResult, run_job
from bench.configs import Job, Scale
from bench.report import BenchReport, Table

Progress = Callable[[str], None]


@dataclass(frozen=True)
class TableDef:
    prefixes: tuple[str, ...]  # the runs it needs: those whose names start with one of these
    build: Callable[[Mapping[str, RunResult], Scale], list[Table]]
    quick: bool  # part of --bench-quick
    about: str


TABLES: dict[str, TableDef] = {
    "systems": TableDef(("systems/",), tables.throughput, True, "throughput of every system at matched batch"),
    "memory": TableDef(("systems/",), tables.memory, True, "host and device memory at equal batch"),
    "slope": TableDef(
        ("systems/",), lambda r, sc: [tables.host_slopes(r, sc).table], True, "host memory per billion parameters"
    ),
    "routes": TableDef(("variants/", "routes/"), tables.routes, True, "SlideDP's parameter and gradient routes"),
    "chunking": TableDef(("variants/", "chunking/"), tables.chunking, True, "gradient-path chunking on/off"),
    "autopolicy": TableDef(("autopolicy/",), tables.autopolicy, True, "AutoPolicy on/off"),
    "loss": TableDef(
        ("loss/",), lambda r, sc: [tables.loss_equivalence(r)[0]], True, "loss equivalence, SlideDP vs FSDP2"
    ),
    "scaling": TableDef(("variants/", "scaling/"), tables.scaling, False, "1 -> R ranks, strong and weak"),
    "moe": TableDef(("moe/",), tables.moe, False, "every system on a Qwen3-MoE shape"),
    "long": TableDef(("long/",), tables.long_context, False, "one long sequence per rank"),
}


class Runs(Mapping[str, RunResult]):
    """Every planned run by name: its result when it has one, else a placeholder with ``missing`` as its status."""

    def __init__(self, specs: dict, done: dict[str, RunResult], missing: dict[str, str] | str) -> None:
        self.specs, self.done, self.missing = specs, done, missing

    def __getitem__(self, name: str) -> RunResult:
        if name in self.done:
            return self.done[name]
        status = self.missing if isinstance(self.missing, str) else self.missing.get(name, "pending")
        return RunResult(name, self.specs[name], status)

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


class Suite:
    """Runs each job once, on first need; keeps every run's result; writes the tables as their runs finish."""

    def __init__(
        self,
        sc: Scale,
        jobs: list[Job],
        report: BenchReport,
        selected: list[str] | None = None,
        progress: Progress = print,
        blocked: dict[str, str] | None = None,
        run=run_job,
    ) -> None:
        self.sc, self.report, self.progress, self.run = sc, report, progress, run
        self.jobs = {j.name: j for j in jobs}
        self.specs = {r.name: r.spec for j in jobs for r in j.runs}
        self.selected = [t for t in (selected if selected is not None else TABLES) if t in TABLES]
        self.blocked = blocked or {}  # system -> why it cannot run (found by bench/prepare.py)
        # a blocked system's rows say why from the start (also when the run stops before its jobs)
        self.done: dict[str, RunResult] = {
            r.name: RunResult(r.name, r.spec, why.split(":", 1)[0], why)
            for j in jobs
            for r in j.runs
            if (why := self.blocked.get(r.spec.system))
        }
        self.ran: set[str] = set()
        self.current: str | None = None  # the job running now
        self.built: set[str] = set()  # tables whose runs have all finished
        self.t0 = time.time()
        needed = {p for t in self.selected for p in TABLES[t].prefixes}
        self.todo = [n for n, j in self.jobs.items() if any(r.name.startswith(tuple(needed)) for r in j.runs)]

    def runs(self, missing: dict[str, str] | str = "pending") -> Runs:
        return Runs(self.specs, self.done, missing)

    def need(self, *prefixes: str) -> Runs:
        """Run every job with a run named by one of ``prefixes`` that has not run yet."""
        pending = [
            n for n, j in self.jobs.items() if n not in self.ran and any(r.name.startswith(prefixes) for r in j.runs)
        ]
        self.todo += [n for n in pending if n not in self.todo]
        for name in pending:
            self._run(name, self.jobs[name])
        return self.runs()

    def _run(self, name: str, job: Job) -> None:
        t0 = time.time()
        n = self.todo.index(name) + 1
        system = job.runs[0].spec.system
        self.current = name
        if system in self.blocked:
            why = self.blocked[system]
            results = [RunResult(r.name, r.spec, why.split(":", 1)[0], why) for r in job.runs]
        else:
            results = self.run([(r.name, r.spec) for r in job.runs], self.report.out / "jobs" / name)
        self.current = None
        self.ran.add(name)
        wall = time.time() - t0
        self.report.timings[f"job {name}"] = wall
        bad = [r for r in results if r.status != "ok"]
        statuses = ", ".join(r.status if len(results) == 1 else f"{r.name} {r.status}" for r in bad) or "ok"
        self.progress(
            f"[{n}/{len(self.todo)}] {name}: {statuses} in {wall:.1f} s (elapsed {time.time() - self.t0:.0f} s)"
        )
        for r in results:
            if not job.memory:  # a shared job's host memory belongs to all its runs: not reported per run
                r.host_peak = r.host_peak_run = r.host_peak_shmem = r.rss_sum_peak = 0
            self.done[r.name] = r
            self.report.runs[r.name] = r.summary()
            for i, loss in enumerate(r.losses):
                self.report.scalar(f"loss/{r.name}", loss, i)
            for i, s in enumerate(r.step_s):
                self.report.scalar(f"step_s/{r.name}", s, r.spec.warmup + i)
        self.refresh()
        self.report.write()

    def _needed(self, table: str) -> list[str]:
        return [n for n in self.specs if n.startswith(TABLES[table].prefixes)]

    def refresh(self, missing: dict[str, str] | str = "pending") -> None:
        """Rebuild every selected table with at least one finished run (the others' runs get ``missing``)."""
        res = self.runs(missing)
        for name in self.selected:
            needed = self._needed(name)
            if any(n in self.done for n in needed):
                for t in TABLES[name].build(res, self.sc):
                    self.report.table(t)

    def table(self, name: str) -> Runs:
        """Run the jobs of table ``name``, build it into the report, write the report (and the plots)."""
        t0 = time.time()
        res = self.need(*TABLES[name].prefixes)
        self.report.timings[f"table {name} (its jobs not run before)"] = time.time() - t0
        for t in TABLES[name].build(res, self.sc):
            self.report.table(t)
        self.built.add(name)
        self.report.write(plots=True)
        return res

    def final_runs(self) -> Runs:
        """Every run: runs never reached are ``not run``, those of the job that was running are ``interrupted``."""
        missing: dict[str, str] = {n: "not run" for n in self.specs if n not in self.done}
        if self.current is not None:
            missing.update({r.name: "interrupted" for r in self.jobs[self.current].runs})
        return self.runs(missing)

    def finish(self) -> None:
        """The last refresh, with :meth:`final_runs`'s statuses."""
        self.refresh(self.final_runs().missing)
