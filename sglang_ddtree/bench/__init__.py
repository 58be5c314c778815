"""The SGLang budget sweep: plain vs DFLASH chain vs DDTREE over budgets and batch sizes.

  plan.py        setups, configuration expansion, memory estimates, skip rules, server arguments, start waves
  server.py      one `python -m sglang.launch_server` process (the real launcher; tests use a fake)
  measure.py     a batch of concurrent streaming /generate requests and what it measured
  prom.py        Prometheus text parsing and before/after diffs (the DDTREE stage split)
  sweep.py       the orchestration: waves, deadline, resume, the results JSONL
  results.py     reading the results JSONL
  cost_model.py  step-time fit T(batch, verify tokens) and projected tokens/s per budget (CLI)
  round_cost.py  `auto`'s offline round-cost model over the committed sweep and kernel bench
  plots.py       PNG plots of a results file (CLI)

Only the standard library is imported by the sweep itself (it runs next to the servers on the GPU machine);
the cost model needs numpy and the plots matplotlib.
"""
