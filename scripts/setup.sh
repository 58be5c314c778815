#!/usr/bin/env bash
# Idempotent setup: a virtualenv in .venv with torch, this package (editable) and the offline/test extras, and
# (as root, with apt-get) Debian's prometheus package for the dashboard test.
# The venv is isolated from the system's site-packages: a torch installed there is not used. torch 2.13.0 is
# installed into .venv unless .venv already has a torch (from an earlier run, or put there by hand); which build
# (CPU or CUDA) comes is whatever pip's configured index serves. $PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch 2.13.0"
  python -m pip install -q "torch==2.13.0"
fi
if ! python -c "import sglang_ddtree, transformers, pytest" >/dev/null 2>&1 || [ pyproject.toml -nt .venv/.ddtree-installed ]; then
  echo "[setup] installing sglang-ddtree (editable) with the offline and test extras"
  python -m pip install -q -e ".[offline,test]"
  touch .venv/.ddtree-installed
fi
# Debian's prometheus binary for tests/test_dashboard.py (root + apt-get; a no-op when already installed)
bash scripts/install_prometheus.sh || echo "[setup] the prometheus install step failed; see scripts/install_prometheus.sh"
python - <<'PY'
import torch, transformers, sglang_ddtree
print(f"[setup] ok: python {__import__('sys').version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, sglang-ddtree {sglang_ddtree.__version__}, "
      f"cuda={'yes' if torch.cuda.is_available() else 'no'}")
PY
