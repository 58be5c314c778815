"""The benchmark harness: the SGLang budget sweep (plain vs DFLASH chain vs DDTREE over budgets and batch sizes) and
the tools that read its results. It lives next to the package, not in it: the wheel ships the product only, and
these run from a checkout (benchmarks/*.py and scripts/ put the repository root on sys.path; pytest runs there).

  plan.py        setups, configuration expansion, memory estimates, skip rules, server arguments, start waves
  server.py      one `python -m sglang.launch_server` process (the real launcher; tests use a fake)
  measure.py     a batch of concurrent streaming /generate requests and what it measured
  prom.py        Prometheus text parsing and before/after diffs (the DDTREE stage split)
  sweep.py       the orchestration: waves, deadline, resume, the results JSONL
  results.py     writing the results JSONL (reading it: sglang_ddtree/results_file.py)
  paired.py      interleaved rows over a base row, run by run, with 95% intervals; the A/B arms' tables
  trace.py       a torch profiler trace of a server, read per round stage (CLI)
  cost_model.py  projected tokens/s per budget from the step-time fit (sglang_ddtree/step_fit.py) (CLI)
  best_budget.py the measured best fixed budget per batch size of one setup of a sweep, ratios over DFLASH (CLI)
  projection.py  DDTREE over DFLASH with a trained drafter: measured round costs x a published acceptance profile (CLI)
  plots.py       PNG plots of a results file (CLI)
  auto_sim.py    `auto`'s host policy fed simulated round times (tests, no GPU)

The round-cost model of the offline `auto` decoder is product code: sglang_ddtree/round_cost.py.

Only the standard library is imported by the sweep itself (it runs next to the servers on the GPU machine);
the cost model needs numpy and the plots matplotlib.
"""
