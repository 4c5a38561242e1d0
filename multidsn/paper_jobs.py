"""``python -m multidsn.train --jobs N``: the paper recipe's (method, seed) runs spread over N processes.

Each run is the one ``multidsn.paper.run`` trains in a single process (same seed, same data, same line), so
the table does not depend on N; only the wall time does. The runs are handed out longest first (the DSN
rows cost 4-5 times a source-only row), which keeps the processes busy to the end. Each process loads the
data itself (it is made from a fixed seed) and appends its lines whole (``paper.append_lines``).
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import torch

from .mnist import paper_domains
from .paper import RunOptions, done, recipe_record, run
from .recipes import PaperRecipe

COST = {"dsn_mmd": 5.1, "dsn_dann": 4.6, "dann": 2.2, "source_only": 1.2, "target_only": 0.9}
"""Relative time per step of each row (results/multidsn_paper.jsonl, 2-core host): the hand-out order."""


def pending(recipe: PaperRecipe, methods: list[str], seeds: list[int], extra_targets: list[str],
            out: str) -> list[tuple[str, int]]:
    """(method, seed) not yet recorded in ``out`` with this recipe, longest first."""
    have = done(out, recipe_record(recipe, extra_targets))
    todo = [(m, s) for s in seeds for m in methods if (m, "mnistm", s) not in have]
    return sorted(todo, key=lambda ms: -COST.get(ms[0], 1.0))


def _one(recipe: PaperRecipe, method: str, seed: int, extra_targets: list[str], opts: RunOptions,
         threads: int, logs: bool) -> int:
    torch.set_num_threads(threads)
    if logs:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{method} seed {seed}] %(message)s")
    source, targets = paper_domains(extra_targets)
    return len(run(recipe, [method], [seed], source, targets, opts))


def run_jobs(recipe: PaperRecipe, methods: list[str], seeds: list[int], extra_targets: list[str],
             opts: RunOptions, jobs: int, threads: int) -> int:
    """Train every pending (method, seed) in ``jobs`` processes; returns the number of lines written."""
    if opts.placement != "single":
        raise ValueError(f"--jobs {jobs} trains each model in a process of its own: use --placement single, "
                         f"or --jobs 1 for placement {opts.placement!r}")
    todo = pending(recipe, methods, seeds, extra_targets, opts.out)
    if not todo:
        return 0
    logs = not opts.quiet
    opts = RunOptions(**{**opts.__dict__, "quiet": True})  # a log line per model, no bars fighting for stderr
    ctx = multiprocessing.get_context("spawn")  # no forked torch thread pools
    fresh = {"max_tasks_per_child": 1} if sys.version_info >= (3, 11) else {}
    # A process pool whose worker dies (killed, out of memory) fails its pending runs with BrokenProcessPool
    # instead of waiting for them forever, as multiprocessing.Pool would.
    with ProcessPoolExecutor(min(jobs, len(todo)), mp_context=ctx, **fresh) as pool:
        futures = {pool.submit(_one, recipe, m, s, extra_targets, opts, threads, logs): (m, s) for m, s in todo}
        written = 0
        for future, (method, seed) in futures.items():
            try:
                written += future.result()
            except BrokenProcessPool as exc:
                raise RuntimeError(f"a training process died, and with it {method} (seed {seed}) and the runs "
                                   f"after it; the lines written so far stay in {opts.out}, and a rerun trains "
                                   f"only what is missing") from exc
        return written
