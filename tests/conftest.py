"""Repo-wide test settings.

One intra-op thread: on the 2-core CI machine torch's default of 2 threads makes the tiny models' small ops
many times slower (measured: a 40-token plain decode of the tiny target took 0.94 s with 2 threads, 0.044 s
with 1).
"""

import torch

torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--planted-bug", default=None,
                     help="switch one planted decoder bug on (sglang_ddtree/offline/planted_bugs.py BUGS) for "
                          "tests/test_correctness_ci.py, to see the CI correctness check fail")
